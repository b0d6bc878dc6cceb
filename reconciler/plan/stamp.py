"""A no-op observation: one shell session per server that compares a stamp and returns.

The facts script (Python on the server: its start, ``ss``, hashes) costs a server ~40 ms of CPU; an SSH session
that runs ``true`` ~6 ms. Most observations (every ``plan``, every ``apply`` of a converged fleet, the loop's drift
check) find the server as it was. So the controller keeps each server's last facts with its **stamp**: what those
facts depend on, read without Python by ``stamp_command`` (``stat`` of every file and folder the facts read, with
nanosecond times and inode, which any write, rename or removal changes; the processes in the engine's unit's
cgroup, which a stop, crash or restart changes; whether our firewall table is loaded, when it matters). The next
observation sends that stamp; the server's shell compares and answers ``=same``, or prints its new stamp and runs
the facts script in the same session (``reconciler.ssh.runner.Unless``).

Kept facts are used only for the same request (the same files asked about) and the same desired state: a plan that
changes something is always made from fresh facts (a port another process took meanwhile is seen then). And only
facts of a settled unit are kept (active, inactive or failed; never starting or stopping: its state would move
without the stamp moving).
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Mapping
from typing import Any

from reconciler.engine.scripts.prelude import UNIT_CGROUPS
from reconciler.ssh import Target

#: Unit states that stay as they are until a process comes or goes (which the stamp sees).
SETTLED = frozenset({"active", "inactive", "failed"})
_CGROUPS = tuple(folder + "/cgroup.procs" for folder in UNIT_CGROUPS)  # each cgroup layout's, ``% service``


def stamp_command(request: Mapping[str, Any]) -> str:
    """POSIX shell printing the stamp of what the facts script reads for ``request`` (``plan.observe.facts_request``):
    no Python, two or three short processes (``stat``, ``cat``, ``nft`` when the firewall matters)."""
    binary = str(request["binary"])
    paths = sorted({*map(str, request["files"]), binary, binary + ".sha256", binary + ".version", str(request["wants"]),
                    str(request["lock"]), *map(str, request["dirs"]), *map(str, request.get("public", ())),
                    *map(str, request.get("private", ())), "/usr/bin/python3"})
    service = str(request["service"])
    parts = ["LC_ALL=C stat -L -c '%n %i %s %.9Y %.9Z' -- " + " ".join(map(shlex.quote, paths)) + " 2>&1",
             "cat " + " ".join(shlex.quote(c % service) for c in _CGROUPS) + " 2>&1"]
    if request.get("firewall"):
        parts.append("nft list table inet reconciler >/dev/null 2>&1; echo nft $?")
    return "; ".join(parts)


class FactsCache:
    """Each server's last facts (the facts script's raw answer) with their stamp and what they were asked for.
    ``entries`` is what ``StateFolder.observed`` keeps between runs; ``changed`` says whether to write it back."""

    def __init__(self, entries: Mapping[str, Any] | None = None):
        self.entries: dict[str, dict[str, str]] = {}
        for name, entry in (entries or {}).items():  # the state folder is input too: anything odd is dropped
            if isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in ("key", "stamp", "facts")):
                self.entries[str(name)] = {k: entry[k] for k in ("key", "stamp", "facts")}
        self.changed = False

    @staticmethod
    def key(target: Target, request: Mapping[str, Any], desired_digest: str) -> str:
        """What kept facts are good for: this server at this address, asked these questions, wanting this state."""
        what = [target.host, target.port, target.user, dict(request), desired_digest]
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()

    def get(self, server: str, key: str) -> tuple[str, str] | None:
        """(stamp, raw facts) kept for ``server`` under ``key``."""
        entry = self.entries.get(server)
        return (entry["stamp"], entry["facts"]) if entry is not None and entry["key"] == key else None

    def put(self, server: str, key: str, stamp: str, facts: str) -> None:
        entry = {"key": key, "stamp": stamp, "facts": facts}
        if self.entries.get(server) != entry:
            self.entries[server] = entry
            self.changed = True

    def drop(self, server: str) -> None:
        if self.entries.pop(server, None) is not None:
            self.changed = True

    def keep_only(self, servers: set[str]) -> None:
        for name in [n for n in self.entries if n not in servers]:
            self.drop(name)
