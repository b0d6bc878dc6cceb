"""The server's apply lock, in one place: where it lives, who holds it, its lease, stale take-over, release.

The lock is a directory on the server (``LOCK_DIR``; ``mkdir`` is atomic) holding ``LOCK_FILE``, a JSON
holder ``{"by": "user@controller", "pid": ..., "since": <unix time>}`` (``holder``). Observation reads it
as a fact (``facts_request`` names ``LOCK_FILE``; ``facts.parse_lock`` parses it, as facts stay pure).
Apply takes the lock before changing a server (``acquire``) and gives it back (``release``); the commit
script releases it itself when the commit is the last step, so an SSH session that dies mid-commit
leaves no lock behind.

A second apply is refused with the holder (``LockHeld``, temporary) unless the lock is stale: its holder
is a process of this controller that is gone, or it is older than the lease. The lease must outlast the
longest bounded step an apply takes under the lock — the engine upload allows 600 s, a commit
``3 × verify_timeout + 60`` s — or a slow but live apply could be taken over: 15 minutes. And while
an apply runs, ``Renewal`` rewrites its holder's ``since`` every third of the lease (``renew``), so even
an apply slower than the lease in all keeps its lock; it stops before a commit that releases the lock.

Fencing: with standby controllers, the leader's applies carry a ``Fence``: its revision goes in
the acquire request and the server refuses it, under the lock, when a newer leader's fence was accepted
there (``FenceRefused``); and ``valid()`` — does this controller still lead? — is asked before the lock and
before the commit, so a deposed leader stops by itself too. Applies without one (no election; an
operator's ``reconciler apply``) are not fenced.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reconciler.engine import remote
from reconciler.errors import FenceRefused as FenceRefused  # raised here; callers catch lock.FenceRefused
from reconciler.errors import LockHeld, RemoteError
from reconciler.plan.facts import parse_lock
from reconciler.ssh import Result, Runner, Script, Target
from reconciler.ssh.runner import Unless, answer

LOCK_DIR = "/run/reconciler.lock"
LOCK_FILE = f"{LOCK_DIR}/holder"
LONGEST_STEP_SECONDS = 600  # the engine upload's timeout (apply.engine.stage_engine)
LEASE_SECONDS = 900  # longer than any bounded step under the lock, so only a dead apply's lock expires
assert LEASE_SECONDS > LONGEST_STEP_SECONDS
FENCE_FILE = "/var/lib/reconciler/fence"  # the highest fence the server has accepted


def _leading() -> bool:
    return True


@dataclass(frozen=True)
class Fence:
    """What a leading controller's applies carry: ``revision``, its election's fence (higher for every newer
    leader), and ``valid``, whether it still leads."""

    revision: int
    valid: Callable[[], bool] = _leading




def check(fence: Fence | None, server: str, step: str) -> None:
    """Raise ``FenceRefused`` when this controller no longer leads (before ``step`` on ``server``)."""
    if fence is not None and not fence.valid():
        raise FenceRefused(f"{step} on {server} not started: this controller (fence {fence.revision}) is no longer "
                           "the leader", server)


def holder(now: float | None = None) -> dict[str, Any]:
    """Who is applying: this user at this controller, this process, since ``now``."""
    return {"by": f"{os.environ.get('USER', 'root')}@{socket.gethostname()}", "pid": os.getpid(),
            "since": int(time.time() if now is None else now)}


def describe(info: dict[str, Any] | None, raw: str = "") -> str:
    """``user@host (pid N) since <UTC time>``, for the operator."""
    if info is not None and "by" in info:
        try:
            since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(int(info.get("since", 0))))
            return f"{info.get('by')} (pid {info.get('pid')}) since {since}"
        except (ValueError, TypeError, OverflowError):
            pass
    return raw.strip() or "unknown"


def is_stale(info: dict[str, Any] | None, now: float, me: dict[str, Any] | None = None) -> bool:
    """A lock left by an apply that died: past the lease, or this controller's with its process gone."""
    if not info:
        return False
    try:
        since = int(info.get("since", 0))
    except (ValueError, TypeError):
        since = 0
    if since and now - since > LEASE_SECONDS:
        return True
    me = me or holder(now)
    if info.get("by") == me["by"] and isinstance(info.get("pid"), int) and info["pid"] != me["pid"]:
        return not os.path.exists(f"/proc/{info['pid']}")
    return False


async def acquire(runner: Runner, target: Target, server: str, dirs: Sequence[str] = (), private: Sequence[str] = (),
                  now: float | None = None, fence: Fence | None = None) -> None:
    """Take the server's lock (one round trip; ``dirs`` are created first, ``private`` ones made 0700).

    A stale lock is taken over; a live one raises ``LockHeld`` naming its holder. With a ``fence``, the
    server refuses it (``FenceRefused``) when a newer leader's fence has applied there."""
    now = time.time() if now is None else now
    request = _request(server, dirs, private, now, fence)
    got = answer(await runner.script(target, remote.LOCK, request), target, remote.LOCK, {"ok": bool})
    await _settle(runner, target, server, request, got, now)


def _request(server: str, dirs: Sequence[str], private: Sequence[str], now: float, fence: Fence | None) -> dict[str, Any]:
    request: dict[str, Any] = {"op": "acquire", "lock": LOCK_DIR, "holder_file": LOCK_FILE, "holder": json.dumps(holder(now)),
                               "dirs": list(dirs), "private": list(private), "take_over": False}
    if fence is not None:
        check(fence, server, "the apply")
        request.update(fence=fence.revision, fence_file=FENCE_FILE)
    return request


async def _settle(runner: Runner, target: Target, server: str, request: dict[str, Any], got: dict[str, Any],
                  now: float) -> None:
    """An acquire's answer: taken (returns); a fence refused, or a live lock (raises); a stale lock is taken over
    (one more round trip)."""
    for take_over in (False, True):
        if take_over:
            got = answer(await runner.script(target, remote.LOCK, {**request, "take_over": True}), target, remote.LOCK,
                         {"ok": bool})
        if got["ok"]:
            return
        if got.get("refused"):
            raise FenceRefused(f"{server}: {str(got['refused'])[:300]}", server)
        raw = str(got.get("holder") or "")[:400]
        info = parse_lock(raw)
        if take_over or not is_stale(info, now):
            break
    raise LockHeld(f"another apply holds the lock on {server}: {describe(info, raw)}. If no apply is running there, "
                   f"remove {LOCK_DIR} on the server (locks also expire after {LEASE_SECONDS // 60} minutes)", server)


class Deferred:
    """A runner (for one server's apply) whose first script takes the server's lock in the same session: the lock
    script takes it, then runs that script in the same Python process (``then``): one round trip and one Python
    start less per server, ~35 ms of a cold server's CPU (on a machine shared by many servers: wall time).

    The lock is the same as ``acquire``'s: a live one raises ``LockHeld`` (the script never ran; what it had on
    stdin was read and dropped), a stale one is taken over and the script then runs on its own, a newer fence is
    refused. A script that reads its request on stdin (the commit) has it read for it by the lock script; one that
    survives a dropped session (the commit) runs with the lock script under ``setsid -w``, and when it was given the
    lock to release (its request's ``lock``), the lock is never given back from here when the session fails (it
    finishes and releases on its own). A script that runs detached, over a fresh
    connection, or with other bytes on stdin besides a request on stdin, is preceded by ``acquire`` instead.
    ``is_taken`` is set once the lock is ours (until then, releasing it is not ours to do)."""

    def __init__(self, runner: Runner, target: Target, server: str, dirs: Sequence[str], private: Sequence[str],
                 fence: Fence | None):
        self.runner, self.target, self.server = runner, target, server
        self.dirs, self.private, self.fence = list(dirs), list(private), fence
        self.pending = True
        self.is_taken = asyncio.Event()  # the apply's release and the Renewal wait for it
        self.since = 0.0  # when the lock's holder was written (its ``since``)

    async def _take_alone(self) -> None:
        """The lock on its own step (``acquire``), before a first step that cannot carry it."""
        self.pending = False
        self.since = time.time()
        await acquire(self.runner, self.target, self.server, self.dirs, self.private, now=self.since, fence=self.fence)
        self.is_taken.set()

    async def script(self, target: Target, script: Script, request: Mapping[str, Any], *, input: bytes | None = None,
                     timeout: float = 120.0, detach: bool = False, fresh: bool = False,
                     unless: Unless | None = None) -> Result:
        if self.pending and target == self.target and unless is None:
            if detach or fresh or (script.stdin and input is not None):
                await self._take_alone()
            else:
                self.pending = False
                now = self.since = time.time()
                plain = _request(self.server, self.dirs, self.private, now, self.fence)
                then: dict[str, Any] = {"then": script.source, "then_name": script.name}
                sent = input
                if script.stdin:  # its request on stdin, read by the lock script for it
                    then.update(then_reads_request=True, then_stdin=True)
                    sent = (script.prepare(request)[1] or "").encode()
                else:
                    then.update(then_request=dict(request), then_stdin=input is not None)
                # A surviving script given the lock to release (the last commit) releases it itself, even when our
                # session is gone: never released from here under it. Any other step's lock is given back below.
                releases_itself = script.survive and bool(request.get("lock"))
                try:
                    res = await self.runner.script(target, remote.LOCK_SURVIVING if script.survive else remote.LOCK,
                                                   {**plain, **then}, input=sent, timeout=timeout)
                    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
                    got = answer(Result(res.code, lines[0] if lines else "", res.stderr), target, remote.LOCK,
                                 {"ok": bool})
                except BaseException:  # the lock may be ours by now (the step failed under it): given back if so
                    if not releases_itself:  # ... unless that step goes on without us and releases it
                        with contextlib.suppress(Exception):
                            await asyncio.wait_for(self.runner.script(target, remote.LOCK, {
                                "op": "release", "lock": LOCK_DIR, "holder_file": LOCK_FILE, "holder": plain["holder"]}),
                                30)
                    raise
                await _settle(self.runner, target, self.server, plain, got, now)  # a take-over: without the script
                self.is_taken.set()
                if got["ok"]:  # the script ran under it: its answer follows the lock's
                    return Result(res.code, "\n".join(lines[1:]), res.stderr)
        return await self.runner.script(target, script, request, input=input, timeout=timeout, detach=detach, fresh=fresh,
                                        unless=unless)

    async def run(self, target: Target, command: str, check: bool = True, timeout: float = 120.0,
                  input: str | bytes | None = None) -> Result:
        if self.pending and target == self.target:  # a raw command first: under the lock, taken on its own
            await self._take_alone()
        return await self.runner.run(target, command, check=check, timeout=timeout, input=input)

    async def close(self) -> None:
        await self.runner.close()


async def release(runner: Runner, target: Target) -> None:
    """Give the lock back (ours: taken by ``acquire``)."""
    await runner.script(target, remote.LOCK, {"op": "release", "lock": LOCK_DIR})


async def renew(runner: Runner, target: Target, now: float | None = None) -> bool:
    """Move our holder's ``since`` to ``now``; False when the lock is gone or no longer ours."""
    request = {"op": "renew", "holder_file": LOCK_FILE, "holder": json.dumps(holder(now))}
    try:
        return bool(answer(await runner.script(target, remote.LOCK, request), target, remote.LOCK, {"ok": bool})["ok"])
    except RemoteError:
        return False


class Renewal:
    """Renews our lock on one server every ``LEASE_SECONDS / 3`` while an apply runs there.

    ``async with Renewal(runner, target):`` around the work under the lock; ``stop()`` ends it early (before
    a commit that releases the lock: a renewal never races a release). A renewal in flight is let finish,
    never cancelled; a failed one is tried again at the next interval; a lock found not ours ends it.
    ``renewed`` counts the renewals made (tests read it)."""

    def __init__(self, runner: Runner, target: Target, every: float | None = None, deferred: Deferred | None = None):
        self.runner, self.target = runner, target
        self.every = LEASE_SECONDS / 3 if every is None else every
        self.renewed = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._deferred = deferred  # a lock taken by the apply's first script: renewed once it is, counted from then

    async def _run(self) -> None:
        delay = self.every
        if self._deferred is not None:
            waiting = asyncio.ensure_future(self._deferred.is_taken.wait())
            stopping = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait([waiting, stopping], return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            stopping.cancel()
            if self._stop.is_set():
                return
            # The lock was written when its script started (a step under it is bounded by LONGEST_STEP_SECONDS, less
            # than the lease): the first renewal is due a third of the lease after that, perhaps at once.
            delay = max(0.0, self._deferred.since + self.every - time.time())
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), delay)
                return
            except TimeoutError:
                pass
            delay = self.every
            try:
                if not await renew(self.runner, self.target):
                    return  # released or taken over: nothing of ours left to renew
                self.renewed += 1
            except RemoteError:
                continue  # the connection may come back before the lease runs out

    async def __aenter__(self) -> Renewal:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
