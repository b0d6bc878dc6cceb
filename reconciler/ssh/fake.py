"""An in-memory fake of the servers for tests: ``FakeRunner`` implements ``Runner`` like httpx's MockTransport.

Each ``FakeHost`` is a temporary directory standing in for one server's file system. The *real*
server-side scripts run as local subprocesses (this Python, ``-I -S``, as on the servers) with the
host's directory as their request's ``root``, so they touch only files under it; ``systemctl``, ``ss``,
``nft`` and the engine binary are the stand-ins of ``reconciler.ssh.fake_tools`` (on ``PATH``, state in
``<root>/.fake/state.json``). Nothing needs root and nothing listens on the network; tests/lab/ runs the
same scripts against real systemd hosts over real SSH.

What a test can script: ``fail_check_if`` / ``fail_start_if`` (the engine rejects, or its unit fails on,
a configuration containing that text), ``reachable`` (connections fail), ``new_connections`` (a fresh
connection fails, as behind a firewall that cuts new SSH sessions) and ``offline`` (its own downloads fail). What it can read: the host's files
(``read``), its units (``unit``), its listeners and firewall table, and every ``systemctl`` call (``log``).
Raw commands (``run``) are refused: every action of plan and apply is a named script.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reconciler.errors import ConnectError, RemoteCommandError, SessionLost
from reconciler.ssh.runner import END_STAMP, SAME, Script, Unless
from reconciler.ssh.types import Result, Target

TOOLS = Path(__file__).with_name("fake_tools.py")


def fake_engine(version: str = "1.14.4") -> bytes:
    """The bytes of a fake engine (as ``sing-box``: ``version``, ``check -c``; as ``mihomo``: ``-v``, ``-t``; it
    answers by the name it runs as): to upload as the engine.

    A fake because the real binary needs root to run as a service and opens real sockets; the fake starts in
    milliseconds. tests/test_engine.py checks the real binary accepts what we render; tests/lab/ runs it."""
    text = TOOLS.read_text().replace('ENGINE_VERSION = "1.14.4"', f"ENGINE_VERSION = {version!r}", 1)
    return f"#!{sys.executable} -IS\n{text}".encode()


class FakeHost:
    """One server: a directory for its ``/`` and the scripted state of its systemd, nftables and engine."""

    def __init__(self, name: str, root: Path):
        self.name = name
        self.root = root
        self.reachable = True
        self.new_connections = True
        self.offline = False  # no route out: its own downloads fail (the controller's do not)
        for d in ("run/systemd/system", "proc/net", "etc/systemd/system/multi-user.target.wants", "usr/local/bin",
                  "usr/local/lib", "etc", "run", ".fake/bin"):
            (root / d).mkdir(parents=True, exist_ok=True)
        tool = f"#!{sys.executable} -IS\n{TOOLS.read_text()}"
        for name_ in ("systemctl", "ss", "nft"):
            path = root / ".fake/bin" / name_
            path.write_text(tool)
            path.chmod(0o755)
        if not (root / ".fake/state.json").exists():
            self._save({"units": {}, "log": [], "nft": None})
            for proto in ("tcp", "udp"):
                (root / "proc/net" / proto).write_text("  sl  local_address rem_address   st\n")

    # ----------------------------------------------------------------- what a test scripts
    def state(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.root / ".fake/state.json").read_text())
        return data

    def _save(self, state: dict[str, Any]) -> None:
        tmp = self.root / ".fake/state.json.test"
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
        tmp.replace(self.root / ".fake/state.json")

    def script(self, **settings: Any) -> None:
        """Set ``fail_check_if`` / ``fail_start_if`` (a text, or None for never)."""
        self._save({**self.state(), **settings})

    # ----------------------------------------------------------------- what a test reads
    def path(self, server_path: str) -> Path:
        return self.root / server_path.lstrip("/")

    def read(self, server_path: str) -> bytes | None:
        p = self.path(server_path)
        return p.read_bytes() if p.is_file() else None

    def write(self, server_path: str, data: bytes) -> None:
        p = self.path(server_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)

    def unit(self, name: str) -> dict[str, Any]:
        """``active`` (active, failed, inactive), ``enabled``, ``listeners`` and how many ``starts``."""
        u = dict(self.state()["units"].get(name, {}))
        u.setdefault("active", "inactive")
        u["enabled"] = os.path.islink(self.path(f"/etc/systemd/system/multi-user.target.wants/{name}"))
        u["listeners"] = sorted(tuple(x) for x in u.get("listeners", []))
        return u

    @property
    def log(self) -> list[str]:
        """Every systemctl call so far, as its arguments."""
        return list(self.state()["log"])

    @property
    def firewall(self) -> str | None:
        """The loaded nftables table, or None."""
        table: str | None = self.state().get("nft")
        return table

    def env(self) -> dict[str, str]:
        env = {**os.environ, "PATH": f"{self.root / '.fake/bin'}{os.pathsep}{os.environ.get('PATH', '')}",
               "FAKE_HOST_ROOT": str(self.root)}
        if self.offline:  # every fetch goes to a proxy that refuses it, as a server with no route out
            env.update(http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9", no_proxy="")
        return env


class FakeRunner:
    """A ``Runner`` over fake hosts (by server name), made on first use under ``base``."""

    def __init__(self, base: Path):
        self.base = base
        self.hosts: dict[str, FakeHost] = {}
        self.calls: list[tuple[str, str, dict[str, Any]]] = []  # (server, script, request) in order
        self._detached: list[asyncio.subprocess.Process] = []

    def host(self, name: str) -> FakeHost:
        if name not in self.hosts:
            self.hosts[name] = FakeHost(name, self.base / name)
        return self.hosts[name]

    def scripts(self, server: str) -> list[str]:
        """The names of the scripts run on ``server``, in order."""
        return [name for s, name, _ in self.calls if s == server]

    async def script(self, target: Target, script: Script, request: Mapping[str, Any], *, input: bytes | None = None,
                     timeout: float = 120.0, detach: bool = False, fresh: bool = False,
                     unless: Unless | None = None) -> Result:
        host = self.host(target.name)
        if not host.reachable or (fresh and not host.new_connections):
            raise ConnectError(f"{target.name} ({target.host}:{target.port}): cannot connect: fake host unreachable",
                               target.name)
        if unless is not None:
            # No shell here: the fake's stamp is every file under the host's root (its service state included), so
            # any change at all runs the script; a real server's is the narrower ``unless.command``.
            stamp = _tree_stamp(host.root)
            if stamp == unless.expected:
                self.calls.append((target.name, script.name + ":same", dict(request)))
                return Result(0, SAME + "\n", "")
            res = await self.script(target, script, request, input=input, timeout=timeout, detach=detach, fresh=fresh)
            return Result(res.code, f"{stamp}\n{END_STAMP}\n{res.stdout}", res.stderr)
        self.calls.append((target.name, script.name, dict(request)))
        text, stdin = script.prepare({**request, "root": str(host.root)})
        data = input if input is not None else (stdin.encode() if stdin is not None else b"")
        if script.installed is not None:  # run what apply installed under the host's root, as a server would
            path = host.root / script.installed.lstrip("/")
            if not path.is_file():
                raise RemoteCommandError(target.name, f"the {script.name} script", 2,
                                         f"python3: can't open file '{script.installed}': [Errno 2] No such file or directory")
        argv = [str(host.root / script.installed.lstrip("/"))] if script.installed else ["-c", text]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", *argv, env=host.env(), cwd=host.root, start_new_session=detach,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL if detach else asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL if detach else asyncio.subprocess.PIPE)
        if detach:
            assert proc.stdin is not None
            proc.stdin.close()
            self._detached.append(proc)
            return Result(0, "", "")
        try:
            out, err = await asyncio.wait_for(proc.communicate(data), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise SessionLost(f"{target.name}: the {script.name} script timed out after {timeout}s", target.name) from None
        except asyncio.CancelledError:  # the caller stopped waiting (the loop stops): nothing of ours keeps running
            proc.kill()
            await asyncio.shield(proc.wait())
            raise
        res = Result(proc.returncode if proc.returncode is not None else -1, out.decode(errors="replace"),
                     err.decode(errors="replace"))
        if res.code != 0:
            raise RemoteCommandError(target.name, f"the {script.name} script", res.code, res.stderr or res.stdout)
        return res

    async def run(self, target: Target, command: str, check: bool = True, timeout: float = 120.0,
                  input: str | bytes | None = None) -> Result:
        raise RemoteCommandError(target.name, command, None, "the fake host runs named scripts only")

    async def close(self) -> None:
        for proc in self._detached:
            await proc.wait()
        self._detached.clear()

    async def __aenter__(self) -> FakeRunner:  # used where an SSHPool is (``async with pool_for(state)``)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _tree_stamp(root: Path) -> str:
    lines = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(folder, name))
                lines.append(f"{os.path.join(folder, name)} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}")
    return "\n".join(lines)
