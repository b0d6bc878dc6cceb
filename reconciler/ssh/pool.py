"""One asyncssh connection per server, host keys pinned (trust on first use, recorded), bounded concurrency.

``SSHPool`` is the real ``reconciler.ssh.runner.Runner``: plan, apply and the loop reach servers through it.

Host keys: a server's key is the one pinned in the cluster file (``ssh.host_key``), else the one remembered
in the state folder (``KnownHosts``), else whatever it presents at first contact — which is then remembered.
That first contact is the one moment a man in the middle would be trusted: ``KnownHosts.first_contact``
names the servers it applies to (plan warns about them), ``SSHPool(strict_host_keys=True)`` refuses them
(``first_contact_refusal``), and ``presented_host_key`` fetches a key without logging in, for
``reconciler hostkeys pin`` to write into the cluster file.
"""

from __future__ import annotations

import asyncio
import json
import random
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncssh

from reconciler.backoff import Backoff
from reconciler.errors import ConnectError, HostKeyChanged, RemoteCommandError, RemoteError, SessionLost
from reconciler.safe_read import read_regular_file
from reconciler.ssh.runner import END_STAMP, SAME, Unless
from reconciler.ssh.types import Result, Target
from reconciler.state.files import write_atomic

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from typing import Any

    from reconciler.ssh.runner import Script






#: The most ``known_hosts.json`` may hold: ~110 bytes a server with an ed25519 key, ~600 with an RSA one (a fleet of
#: tens of thousands); a bigger file is not one this controller wrote, and is not read.
MAX_KNOWN_HOSTS_BYTES = 16 * 1024 * 1024


class KnownHosts:
    """Host keys seen on first contact, recorded in a JSON file (`host:port` → `type base64`)."""

    def __init__(self, path: Path):
        self.path = path
        self.keys: dict[str, str] = {}
        self.note = ""  # why the recorded keys could not be read (then none are trusted from the file)
        try:
            raw = json.loads(read_regular_file(str(path), MAX_KNOWN_HOSTS_BYTES))  # no FIFO, no 10 GB file
        except FileNotFoundError:
            raw = {}
        except OSError as exc:  # not a regular file, too big, not ours to read: said in full
            why = exc.strerror or type(exc).__name__
            raw, self.note = {}, (f"ignoring {path}: {'it ' if why.startswith('is ') else ''}{why}; host keys are learnt "
                                  "again on first contact (move the file aside, or pin the keys with `reconciler "
                                  "hostkeys pin`)")
        except (ValueError, RecursionError) as exc:
            raw, self.note = {}, f"ignoring unreadable {path} ({type(exc).__name__}); host keys are learnt again on first contact"
        if isinstance(raw, dict):
            self.keys = {str(k): v for k, v in raw.items() if isinstance(v, str)}

    def get(self, target: Target) -> str | None:
        """The key ``target`` must present: pinned in the file, else remembered; None at first contact."""
        return target.host_key or self.remembered(target)

    def remembered(self, target: Target) -> str | None:
        return self.keys.get(f"{target.host}:{target.port}")

    def first_contact(self, targets: Iterable[Target]) -> list[Target]:
        """The targets with neither a pinned nor a remembered key: connecting trusts whatever they present."""
        return [t for t in targets if self.get(t) is None]

    def record(self, target: Target, key: str) -> None:
        self.keys[f"{target.host}:{target.port}"] = key
        write_atomic(self.path, json.dumps(self.keys, indent=2, sort_keys=True).encode(), 0o600)


# AES-GCM first: with the AES instructions every current x86-64 and arm64 controller has, it costs about
# half the CPU of ChaCha20-Poly1305 (asyncssh's default first choice) on both ends of a large upload.
CIPHERS = ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com",
           "aes128-ctr", "aes192-ctr", "aes256-ctr"]

# Keepalives: a connection running a session sends one after KEEPALIVE_S of silence, and three unanswered close
# it (a cut server is found within ~20 s, mid-step). Between sessions a pooled connection sends them only after
# IDLE_KEEPALIVE_S: every 5 s there was ~11 round trips a minute per server between the loop's reports, 140-300 µs
# of the controller's CPU each (a thousand servers: ~1 CPU-s of every minute, bench/fleet_scale.py). Longer
# than the usual report interval, so the loop's connections send none; below NATs' idle timeouts for TCP.
KEEPALIVE_S = 5
IDLE_KEEPALIVE_S = 120

#: A connection that failed is tried again after 0.5 s, then 1 s (with up to half more at random: a fleet's worth of
#: connections that failed together do not all come back at once).
CONNECT_BACKOFF = Backoff(first=0.5, cap=30.0, jitter=0.5)
_RETRYABLE = (OSError, asyncio.TimeoutError, asyncssh.ConnectionLost, asyncssh.DisconnectError)


def in_words(exc: BaseException | None) -> str:
    """Why a connection failed, as an operator says it (never a raw ``[Errno 111] Connect call failed``)."""
    import errno
    import socket

    if exc is None or isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "timed out (the host is down, or a firewall drops the port)"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is sshd running, and is ssh.port right?)"
    if isinstance(exc, socket.gaierror):
        return "the name does not resolve (check `host:`)"
    if isinstance(exc, ConnectionResetError):
        return "the connection was reset (sshd or a firewall closed it)"
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "no route to the host (check `host:` and this machine's network)"
    if isinstance(exc, asyncssh.DisconnectError):
        return f"the server closed the connection: {exc.reason}"
    if isinstance(exc, asyncssh.ConnectionLost):
        return "the connection was lost"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[:1].lower() + exc.strerror[1:]
    return str(exc) or type(exc).__name__


def first_contact_warning(target: Target) -> str:
    return (f"first contact with {target.name} ({target.host}:{target.port}) will trust whatever key it presents; "
            f"pin it first with `reconciler hostkeys pin --server {target.name}` (or refuse with --strict-host-keys)")


def first_contact_refusal(target: Target) -> str:
    return (f"{target.name} ({target.host}:{target.port}): not connecting — no host key is pinned (ssh.host_key) or "
            f"remembered for it and --strict-host-keys is set; pin it with `reconciler hostkeys pin --server {target.name}`")


# The key types asked for at first contact, the one operators pin first (like OpenSSH prefers it).
FIRST_CONTACT_ALGS = ["ssh-ed25519", "ecdsa-sha2-nistp256", "rsa-sha2-512", "rsa-sha2-256"]


def openssh_line(key: asyncssh.SSHKey) -> str:
    """``type base64``: a public key as ``ssh.host_key`` and the known-hosts record hold it."""
    return " ".join(key.export_public_key("openssh").decode().split()[:2])


async def presented_host_key(target: Target, timeout: float = 10.0) -> str:
    """The host key ``target`` presents (``type base64``), from a key exchange alone: no login, nothing run.
    ``ConnectError`` when it cannot be reached."""
    try:
        key = await asyncio.wait_for(asyncssh.get_server_host_key(
            target.host, target.port, server_host_key_algs=FIRST_CONTACT_ALGS), timeout)
    except (*_RETRYABLE, asyncssh.Error) as exc:
        raise ConnectError(f"{target.name} ({target.host}:{target.port}): cannot get its host key: {str(exc) or 'timed out'}",
                           target.name) from exc
    if key is None:
        raise ConnectError(f"{target.name} ({target.host}:{target.port}): presented no host key", target.name)
    return openssh_line(key)


class SSHPool:
    """Connections by server name. Concurrency is bounded; connection errors retry with backoff."""

    def __init__(self, known_hosts: KnownHosts, concurrency: int = 32, connect_timeout: float = 10.0,
                 retries: int = 2, backoff: Backoff = CONNECT_BACKOFF, strict_host_keys: bool = False):
        self.known = known_hosts
        self.strict_host_keys = strict_host_keys  # refuse first contact: only pinned or remembered keys
        self.sem = asyncio.Semaphore(concurrency)
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.backoff = backoff
        self._conns: dict[str, asyncssh.SSHClientConnection] = {}
        self._busy: dict[asyncssh.SSHClientConnection, int] = {}  # sessions running on each connection
        self._keys: dict[str, asyncssh.SSHKey] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def connection(self, target: Target) -> asyncssh.SSHClientConnection:
        lock = self._locks.setdefault(target.name, asyncio.Lock())
        async with lock:
            conn = self._conns.get(target.name)
            if conn is not None and not conn.is_closed():
                return conn
            conn = await self._connect(target)
            self._conns[target.name] = conn
            return conn

    def _identity(self, path: str) -> asyncssh.SSHKey:
        """The private key at ``path``, read bounded (a regular file only: never a device, a FIFO or /proc)
        and parsed once per pool; a key that cannot be read is this server's ``ConnectError``."""
        key = self._keys.get(path)
        if key is None:
            try:
                key = self._keys[path] = asyncssh.import_private_key(read_regular_file(path, 64 * 1024))
            except OSError as exc:
                raise ConnectError(f"cannot read the SSH key {path}: {exc.strerror or exc}") from None
            except (asyncssh.KeyImportError, ValueError) as exc:
                raise ConnectError(f"the SSH key {path} cannot be used: {exc} (an encrypted key needs an agent)") from None
        return key

    async def _connect(self, target: Target) -> asyncssh.SSHClientConnection:
        pinned = self.known.get(target)
        if pinned is None and self.strict_host_keys:
            raise RemoteError(first_contact_refusal(target), target.name)
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                known: tuple[list[asyncssh.SSHKey], list[asyncssh.SSHKey], list[asyncssh.SSHKey]] | None = (
                    ([asyncssh.import_public_key(pinned)], [], []) if pinned else None)
                kwargs: dict[str, object] = {"client_keys": [self._identity(target.identity)]} if target.identity else {}
                if not pinned:  # first contact: record the key operators pin, like OpenSSH prefers it
                    kwargs["server_host_key_algs"] = FIRST_CONTACT_ALGS
                conn = await asyncio.wait_for(asyncssh.connect(
                    target.host, port=target.port, username=target.user, known_hosts=known,
                    connect_timeout=self.connect_timeout, keepalive_interval=KEEPALIVE_S, keepalive_count_max=3,
                    encryption_algs=CIPHERS, **kwargs), self.connect_timeout + 5)
                if not pinned:  # trust on first use: record what we saw, refuse any change later
                    key = conn.get_server_host_key()
                    if key is not None:
                        self.known.record(target, openssh_line(key))
                return conn
            except asyncssh.HostKeyNotVerifiable as exc:
                raise HostKeyChanged(
                    f"{target.name} ({target.host}): the host key differs from the pinned one — refusing to connect. "
                    "If the server was really reinstalled, remove its entry from the known-hosts state "
                    "(or update `ssh.host_key` in the cluster file)") from exc
            except asyncssh.PermissionDenied as exc:
                raise ConnectError(f"{target.name} ({target.host}): our SSH key was refused as {target.user}") from exc
            except _RETRYABLE as exc:
                last = exc
                if attempt < self.retries:
                    await asyncio.sleep(self.backoff.wait(attempt + 1, random.random()))
        raise ConnectError(f"cannot reach {target.name} at {target.host}:{target.port}: {in_words(last)}")

    async def fresh(self, target: Target) -> asyncssh.SSHClientConnection:
        """A new connection outside the pool (to prove a new session still gets through); caller closes it."""
        return await self._connect(target)

    async def run(self, target: Target, command: str, check: bool = True, timeout: float = 120.0,
                  input: str | bytes | None = None) -> Result:
        async with self.sem:
            conn = await self.connection(target)
            self._busy[conn] = self._busy.get(conn, 0) + 1
            if self._busy[conn] == 1:
                conn.set_keepalive(KEEPALIVE_S)
            try:
                res = await _execute(conn, command, timeout, input)
            except _RETRYABLE as exc:
                if self._conns.get(target.name) is conn:  # lost, or hung: the next run connects afresh
                    del self._conns[target.name]
                raise SessionLost(f"{target.name}: connection lost while running a command: {exc}") from exc
            finally:
                self._busy[conn] -= 1
                if not self._busy[conn]:
                    del self._busy[conn]
                    if self._conns.get(target.name) is not conn or conn.is_closed():
                        if self._conns.get(target.name) is conn:
                            del self._conns[target.name]
                        conn.close()  # dropped from the pool and its last session is over (else it stays open)
                    else:
                        conn.set_keepalive(IDLE_KEEPALIVE_S)
        if check and res.code != 0:
            raise RemoteCommandError(target.name, command, res.code, res.stderr)
        return res

    async def script(self, target: Target, script: Script, request: Mapping[str, Any], *, input: bytes | None = None,
                     timeout: float = 120.0, detach: bool = False, fresh: bool = False,
                     unless: Unless | None = None) -> Result:
        """``Runner.script``: ``python3 -I -S -c <text>`` on the server (see ``reconciler.ssh.runner``)."""
        text, stdin = script.prepare(request)
        if input is not None:
            if stdin is not None:
                raise ValueError(f"script {script.name} reads its request on stdin: no other input")
        command = f"python3 -I -S {shlex.quote(script.installed)}" if script.installed else \
            f"python3 -I -S -c {shlex.quote(text)}"
        if script.survive:
            command = f"setsid -w {command}"
        if detach:  # detached stdio too: else SSH waits for the script to end
            command = f"setsid -f {command} < /dev/null > /dev/null 2>&1"
        if unless is not None:  # the stamp first, in the same session: the script runs only when it changed
            command = (f"s=$({unless.command}); if [ \"$s\" = {shlex.quote(unless.expected)} ]; then echo {SAME}; "
                       f"else printf '%s\\n{END_STAMP}\\n' \"$s\"; {command}; fi")
        data = input if input is not None else stdin
        if not fresh:
            res = await self.run(target, command, check=False, timeout=timeout, input=data)
        else:
            async with self.sem:
                conn = await self.fresh(target)  # a new TCP connection: established ones pass any firewall
                try:
                    res = await _execute(conn, command, timeout, data)
                except (*_RETRYABLE, asyncssh.Error) as exc:
                    raise SessionLost(f"{target.name}: a fresh connection failed while running {script.name}: {exc}",
                                      target.name) from exc
                finally:
                    conn.close()
        if res.code != 0:
            raise RemoteCommandError(target.name, f"the {script.name} script", res.code, res.stderr or res.stdout)
        return res

    async def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        for conn in self._conns.values():
            await conn.wait_closed()
        self._conns.clear()

    async def __aenter__(self) -> SSHPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()



class _Collected(asyncssh.SSHClientSession[bytes]):
    """One command's session, kept whole in memory: its output as it arrives, its exit status, its end. Leaner
    than ``conn.run``'s process and stream layers, which cost ~15% more of the controller's CPU per session (a
    thousand servers' agents every interval)."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.err: list[bytes] = []
        self.status: int | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes, datatype: int | None) -> None:
        (self.err if datatype == asyncssh.EXTENDED_DATA_STDERR else self.out).append(data)

    def exit_status_received(self, status: int) -> None:
        self.status = status

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            if exc is None:
                self.closed.set_result(None)
            else:
                self.closed.set_exception(exc)


async def _execute(conn: asyncssh.SSHClientConnection, command: str, timeout: float, input: str | bytes | None) -> Result:
    """``command`` on ``conn`` with ``input`` on its stdin (then end of file); its output is decoded as UTF-8,
    anything else in it replaced (a server's answer is untrusted: it is parsed later, never decoded strictly)."""
    async with asyncio.timeout(timeout):  # one deadline for the whole session
        session = _Collected()
        chan, _ = await conn.create_session(lambda: session, command, encoding=None)
        try:
            if input:
                chan.write(input.encode() if isinstance(input, str) else input)
            chan.write_eof()
            await session.closed
        except BaseException:
            chan.close()  # a timeout or a cancel: the session ends here, not on the server's terms
            raise
    code = session.status if session.status is not None else -1  # a signal, or closed without a status
    return Result(code, b"".join(session.out).decode(errors="replace"), b"".join(session.err).decode(errors="replace"))
