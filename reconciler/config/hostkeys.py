"""In-place pinning of servers' host keys: ``reconciler hostkeys pin`` writes ``ssh.host_key`` into the cluster file.

The same machinery as ``route assign`` (``reconciler.config.edit``): ruamel finds each server and the positions
of its keys, the edit is a splice of the original text, so comments, order and quoting stay; every file touched
(the main file, or the include a server is declared in) is checked together with the rest of the cluster before
anything is written, then written atomically. A server that already has ``ssh.host_key`` is left as it is:
replacing a pinned key is the operator's decision, made by hand.

    pin_host_keys(path, {server: "ssh-ed25519 AAAA…"}) -> PinResult
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from ruamel.yaml import YAML

from reconciler.config.diagnostics import Diagnostic
from reconciler.config.edit import _atomic_write, _set_key
from reconciler.config.loader import load_cluster
from reconciler.config.yamlread import read_text
from reconciler.errors import EditError, Problem
from reconciler.model.types import host_key_blob


@dataclass
class PinResult:
    pinned: dict[str, str] = field(default_factory=dict)  # server → the file its key was written into
    already: list[str] = field(default_factory=list)  # servers that had ssh.host_key: untouched
    warnings: list[Diagnostic] = field(default_factory=list)


def pin_host_keys(path: str, keys: dict[str, str]) -> PinResult:
    """Write each ``keys[server]`` (an OpenSSH public key line) as that server's ``ssh.host_key``; one check, then
    every touched file written. ``EditError`` (nothing written) when a server is unknown, a key is not a key,
    or the edit would leave the cluster invalid."""
    loaded = load_cluster(path)
    cluster = loaded.cluster
    if cluster is None:
        raise EditError("the file has errors; fix them first", loaded.errors)
    result = PinResult()
    by_file: dict[str, list[str]] = {}
    index = {s.name: i for i, s in enumerate(cluster.servers)}
    for name, key in keys.items():
        if name not in index:
            raise EditError(f"no server named {name[:80]!r}; known: {', '.join(index) or 'none'}")
        try:
            host_key_blob(key)
        except ValueError as exc:
            raise EditError(f"{name}: {key[:80]!r} is not an OpenSSH public key ({exc})") from None
        if cluster.servers[index[name]].ssh.host_key:
            result.already.append(name)
            continue
        pos = loaded.source.key(("servers", index[name]))
        by_file.setdefault(pos.file if pos and pos.file else loaded.path, []).append(name)
    texts: dict[str, str] = {}
    for file, names in by_file.items():
        try:
            text = read_text(file, file)
        except Problem as problem:
            raise EditError(f"cannot read {file}: {problem.diagnostic.message}") from None
        for name in names:
            text = _pin_one(text, file, name, keys[name])
            result.pinned[name] = file
        texts[os.path.abspath(file)] = text
    if not texts:
        return result
    check = load_cluster(path, overrides=texts)
    if check.cluster is None:
        raise EditError("pinning would make the file invalid; nothing was written", check.errors)
    for file, text in texts.items():
        _atomic_write(file, text)
    result.warnings = check.warnings
    return result


def _pin_one(text: str, file: str, name: str, key: str) -> str:
    server = _find_server(text, name)
    if server is None:
        raise EditError(f"could not locate server {name!r} in {file}")
    value = f'"{" ".join(key.split())}"'  # quoted: the line holds a space; base64 needs no escaping
    ssh = server.get("ssh")
    if ssh is None:
        return _set_key(text, server, "ssh", f"{{host_key: {value}}}")
    if not hasattr(ssh, "lc"):
        raise EditError(f"server {name!r} in {file}: `ssh` is not a mapping; add ssh.host_key by hand")
    return _set_key(text, ssh, "host_key", value)


def _find_server(text: str, name: str) -> Any:
    with warnings.catch_warnings():  # a reused anchor warns; the loader already accepted the file
        warnings.simplefilter("ignore")
        doc = YAML(typ="rt").load(text)
    for server in (doc or {}).get("servers") or []:
        if isinstance(server, dict) and str(server.get("name")) == name:
            return server
    return None
