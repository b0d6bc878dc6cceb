"""The state folder beside the cluster file (``settings.outputs.state_dir``), the one place that
reads and writes it.

What it holds: ``known_hosts.json`` (host keys seen on first contact), ``facts.json`` (public
material servers generated: the pins of self-signed certificates), ``managed.json`` (servers
an apply has managed, with how to reach them, for pruning), ``observed.json`` (each server's last facts and
their stamp: a server that still looks so is observed without its facts script, ``reconciler.plan.stamp``),
``releases.json`` (the version each engine release's binary reported, by its sha256: a server downloading a known
release stages it in its commit, ``reconciler.apply.engine.in_commit``), ``learned.npz`` (the fleet core's
learned state) and the file outlet's manifest. Every write goes through
``reconciler.state.files.write_atomic`` (mode 0600); the folder, and every folder above it that had to be made
for it, is made 0700 (``make_private_dirs``).

A JSON file that cannot be read is reported (``notes``) and treated as empty — a fresh start,
named, never silent and never an exception in the loop. Every file is read only when it is a regular file
(a FIFO put in its place never blocks the loop) of a bounded size: ``MAX_JSON_FILE_BYTES``, and for the learned
state ``MAX_LEARNED_FILE_BYTES`` (``Learned.restore`` checks what it holds).

``lock()`` is an advisory lock on the folder (``flock`` on ``.lock``): one apply or loop at a
time per state folder on this machine. The servers' own apply locks are separate (plan/lock).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reconciler.errors import LockHeld
from reconciler.fleet.learned import MAX_STATE_BYTES, Learned
from reconciler.model import Cluster
from reconciler.safe_read import read_regular_file
from reconciler.state.files import make_private_dirs, write_atomic

KNOWN_HOSTS = "known_hosts.json"
FACTS = "facts.json"
MANAGED = "managed.json"
OBSERVED = "observed.json"
RELEASES = "releases.json"
LEARNED = "learned.npz"
MAX_LEARNED_FILE_BYTES = MAX_STATE_BYTES  # compressed, it is smaller than what it may inflate to
MAX_JSON_FILE_BYTES = 64 << 20  # facts.json and managed.json are kilobytes for a fleet of thousands


@dataclass
class StateFolder:
    path: Path
    notes: list[str] = field(default_factory=list)  # what could not be read, for the caller to log or print

    @classmethod
    def of(cls, cluster_file: str | Path, state_dir: str) -> StateFolder:
        """The state folder of a cluster file (``state_dir`` relative to the file's folder)."""
        return cls(Path(cluster_file).resolve().parent / os.path.expanduser(state_dir))

    # ------------------------------------------------------------------ JSON documents

    def read_json(self, name: str) -> dict[str, Any]:
        """The JSON object in ``name``, or {} when it is missing or unreadable (noted)."""
        f = self.path / name
        try:
            raw = self.read_bytes(name)
            if raw is None:
                return {}
            data = json.loads(raw)
        except (OSError, ValueError, RecursionError) as exc:
            self.notes.append(f"ignoring unreadable {f} ({type(exc).__name__}: {str(exc)[:200]}); starting afresh")
            return {}
        if not isinstance(data, dict):
            self.notes.append(f"ignoring {f}: not a JSON object; starting afresh")
            return {}
        return data

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        self.write_bytes(name, json.dumps(data, indent=2, sort_keys=True).encode())

    def read_bytes(self, name: str, max_bytes: int = MAX_JSON_FILE_BYTES) -> bytes | None:
        """The content of ``name``, None when it is missing; ``OSError`` when it is not a regular file or is longer
        than ``max_bytes``."""
        try:
            return read_regular_file(str(self.path / name), max_bytes)
        except FileNotFoundError:
            return None

    def write_bytes(self, name: str, data: bytes) -> None:
        make_private_dirs(self.path)
        write_atomic(self.path / name, data, 0o600)

    # ------------------------------------------------------------------ what is kept

    def facts(self) -> dict[str, dict[str, str]]:
        """Public material on record: {"public_keys": {inbound: key}, "tls_pins": {inbound: pin}}."""
        raw = self.read_json(FACTS)
        out: dict[str, dict[str, str]] = {}
        dropped = 0
        for kind in ("public_keys", "tls_pins"):
            value = raw.get(kind, {})
            good = {str(k): v for k, v in value.items() if isinstance(v, str)} if isinstance(value, dict) else {}
            dropped += (len(value) if isinstance(value, dict | list) else 1) - len(good)
            out[kind] = good
        if dropped:
            self.notes.append(f"{self.path / FACTS}: {dropped} malformed entr(ies) ignored; an apply records them again")
        return out

    def observed(self) -> dict[str, Any]:
        """Each server's last facts and stamp (``reconciler.plan.stamp.FactsCache`` checks every entry)."""
        return self.read_json(OBSERVED)

    def remember_observed(self, entries: dict[str, Any]) -> None:
        self.write_json(OBSERVED, entries)

    def release_versions(self) -> dict[str, Any]:
        """What each engine release's binary reported as its version, by the release's sha256
        (``reconciler.apply.engine.learn`` checks every entry)."""
        return self.read_json(RELEASES)

    def remember_release_versions(self, versions: dict[str, str]) -> None:
        if versions != self.read_json(RELEASES):
            self.write_json(RELEASES, versions)

    def remember_facts(self, learned: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        """Merge newly learned public material into the record; returns the record."""
        old = self.facts()
        facts = {k: {**old.get(k, {}), **v} for k, v in learned.items()}
        for k, v in old.items():
            facts.setdefault(k, v)
        self.write_json(FACTS, facts)
        return facts

    def managed(self) -> dict[str, dict[str, Any]]:
        """Servers an apply has managed: name → how to reach it (for pruning what left the file)."""
        raw = self.read_json(MANAGED)
        good = {str(k): v for k, v in raw.items() if isinstance(v, dict)}
        if len(good) < len(raw):
            self.notes.append(f"{self.path / MANAGED}: {len(raw) - len(good)} malformed entr(ies) ignored")
        return good

    def write_managed(self, managed: dict[str, dict[str, Any]]) -> None:
        self.write_json(MANAGED, managed)

    def load_learned(self, cluster: Cluster) -> Learned:
        """The learned state adopted to ``cluster``; unreadable → a fresh one, noted."""
        try:
            data = self.read_bytes(LEARNED, MAX_LEARNED_FILE_BYTES)
        except OSError as exc:
            data = None
            self.notes.append(f"cannot read {self.learned}: {exc.strerror}; starting afresh")
        learned, note = Learned.restore(data, cluster, str(self.learned))
        if note:
            self.notes.append(note)
        return learned

    def save_learned(self, learned: Learned) -> None:
        self.save_learned_bytes(learned.to_bytes())

    def save_learned_bytes(self, data: bytes) -> None:
        """``Learned.to_bytes``' output, written as the learned state."""
        self.write_bytes(LEARNED, data)

    @property
    def known_hosts(self) -> Path:
        return self.path / KNOWN_HOSTS

    @property
    def learned(self) -> Path:
        return self.path / LEARNED

    # ------------------------------------------------------------------ one writer at a time

    @contextlib.contextmanager
    def lock(self, what: str = "apply") -> Iterator[None]:
        """Hold the folder's lock, or raise ``LockHeld`` naming who holds it."""
        make_private_dirs(self.path)
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                raise LockHeld(f"the state folder {self.path} is in use by {holder}; wait for it to finish") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{what} (pid {os.getpid()})".encode(), 0)
            yield
        finally:
            os.close(fd)
