"""The server scripts' shared prelude: tested once here, spliced into every script (and the agent) when sent."""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys

import pytest

from reconciler.engine import remote
from reconciler.engine.base import AGENT_SOURCE
from reconciler.engine.scripts import prelude, spliced

SENT = [remote.FACTS, remote.COMMIT, remote.ENGINE, remote.FIREWALL, remote.LOCK, remote.FILES, remote.ACME]


@pytest.mark.parametrize("text", [s.source for s in SENT] + [AGENT_SOURCE.decode()],
                         ids=[s.name for s in SENT] + ["agent"])
def test_every_sent_script_carries_the_prelude_and_never_imports_the_reconciler(text):
    tree = ast.parse(text, feature_version=(3, 6) if "collection agent" in text else (3, 7))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.startswith("reconciler")}
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"at", "listening_ports", "write"} & defined  # at least what it uses, from the prelude's one text
    assert text.count("# --- prelude") == 1
    # It runs alone: compiled by the standard library's python without the reconciler on its path.
    out = subprocess.run([sys.executable, "-I", "-S", "-c", f"compile({text!r}, 'script', 'exec')"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_the_prelude_is_one_text_whatever_imports_it():
    assert spliced("from reconciler.engine.scripts.prelude import at  # x\nprint(at('/', '/a'))\n").count("def at(") == 1
    assert spliced("x = 1\n") == "x = 1\n"  # a script without the import is sent as it is


def test_write_replaces_atomically_and_durably(tmp_path, monkeypatch):
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    path = str(tmp_path / "f")
    prelude.write(path, b"old", 0o600)
    prelude.write(path, b"new", 0o640)
    with open(path, "rb") as f:
        assert f.read() == b"new" and os.stat(path).st_mode & 0o777 == 0o640
    assert len(synced) == 4  # the file and its folder, each time
    assert os.listdir(tmp_path) == ["f"]


def test_listening_ports_reads_the_kernels_tables():
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    udp = socket.socket(type=socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    try:
        t, u = tcp.getsockname()[1], udp.getsockname()[1]
        assert (t, "tcp") not in prelude.listening_ports("/")  # bound, not listening yet
        tcp.listen()
        have = prelude.listening_ports("/")
        assert (t, "tcp") in have and (u, "udp") in have and (u, "tcp") not in have
    finally:
        tcp.close()
        udp.close()
    assert prelude.listening_ports("/nonexistent") == set()
    assert prelude.at("/", "/etc/x") == "/etc/x" and prelude.at("/tmp/host/", "/etc/x") == "/tmp/host/etc/x"
