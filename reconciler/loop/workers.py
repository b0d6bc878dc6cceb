"""The live endpoint on more than one core: worker processes sharing the public port.

With ``settings.outputs.workers`` above 1 the loop's process keeps collection, the files and the
operations listener, and ``LiveWorkers`` starts that many worker processes that answer the public
listener (``/sub/<token>``, ``/healthz``) — each binds ``listen`` with SO_REUSEPORT, so the kernel
spreads new connections among them, and each runs the same guarded listener
(``reconciler.loop.fastlistener``) answering what ``reconciler.loop.public`` decides over its own
``LiveAnswers``, as the single-process outlet does.

- **Started clean**: the ``spawn`` context (a fresh interpreter), never a fork of a process with
  a running event loop and threads. The master secret goes over the worker's pipe as its first
  message — never on a command line, in a file or in the environment.
- **The same snapshot**: every interval the loop's snapshot is pickled into the state folder
  (0600, replaced atomically, sealed with an HMAC under a key derived from the master secret:
  ``reconciler.state.files.sealed``) and its generation is sent to every worker, which checks the
  HMAC before it unpickles anything — a file someone else put there is refused with one line in
  the log, and the worker answers from the snapshot it has meanwhile — and then loads it and
  answers from it with the same pure ``render``: bytes and ETags equal the files'. The cluster —
  the big part, 100k users are ~10 MB and ~0.7 s to load — is written to a file of its own only
  when it changes; an interval's snapshot without it is ~2 MB and ~15 ms each way. A worker
  loads in a thread and swaps the snapshot in at once; until then it answers from the one it has.
- **Health**: once a second the loop's process sends its own verdict (``Loop._healthy``: on time,
  no failing task); a worker's ``/healthz`` is 200 while that word is fresh (``HEALTH_FRESH``) and
  good, and its own last load succeeded.
- **Supervised**: a worker that dies is logged with its exit status and started again after a
  backoff (0.5 s doubling to 30 s, back to 0.5 s once one has run a minute). Connections queued
  on the dead worker's socket are reset by the kernel; new ones go to the others meanwhile.
- **No orphans**: ``stop`` asks each worker to stop, then sends SIGTERM and SIGKILL to its PID
  if it has not; a worker also stops by itself when its pipe to the loop's process closes (that
  process died, however it died).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from reconciler.backoff import Backoff
from reconciler.balance import Snapshot, decide
from reconciler.credentials import Secret
from reconciler.errors import MacMismatch, WorkerStartError
from reconciler.loop.listener import Guards, Limits
from reconciler.publish import LiveAnswers, Tokens
from reconciler.state.files import make_private_dirs, sealed, unsealed, write_atomic
from reconciler.text import PrintableFormatter

log = logging.getLogger("reconciler.live")

CLUSTER_FILE = "live-cluster.pickle"
SNAPSHOT_FILE = "live-snapshot.pickle"
HEARTBEAT = 1.0  # seconds between two health messages to the workers
HEALTH_FRESH = 15.0  # a worker that heard nothing from the loop's process for longer says unhealthy
HUNG_AFTER = 30.0  # a worker that has not answered a heartbeat for this long is killed (and so started again)
READY_TIMEOUT = 60.0  # a worker's start: interpreter, imports, the current snapshot (100k users ~1.5 s), bind
STOP_TIMEOUT = 5.0  # asked to stop, then SIGTERM, then SIGKILL
STABLE_AFTER = 60.0
#: A worker that ended starts again after 0.5 s, doubling to 30 s; back to 0.5 s once one has run ``STABLE_AFTER``.
RESTART_BACKOFF = Backoff(first=0.5, cap=30.0)


def worker_count(setting: int | str) -> int:
    """``settings.outputs.workers`` as a number of processes: 0 or ``auto`` is one per CPU."""
    if setting in (0, "auto"):
        return os.cpu_count() or 1
    return max(1, int(setting))


@dataclass
class WorkerStats:
    slot: int
    pid: int
    served: int  # requests its public listener handled
    generation: int  # the snapshot it answers from (0: none yet)


@dataclass
class _Worker:
    slot: int
    process: BaseProcess
    conn: Connection
    started: float
    ready: asyncio.Future[tuple[Any, ...]]
    replies: asyncio.Queue[tuple[Any, ...] | None]
    pid: int = 0
    closed: bool = False  # discarded: its process object may no longer be asked anything
    heard: float = 0.0  # when it last said anything (monotonic)

    @property
    def listening(self) -> bool:
        return not self.closed and self.ready.done() and self.ready.result()[0] == "ready"


class LiveWorkers:
    """The loop's side: starts, feeds, watches and stops the worker processes."""

    def __init__(self, count: int, host: str, port: int, secret: Secret, folder: Path, base_dir: str,
                 health: Callable[[], tuple[bool, str]], limits: Limits | None = None):
        import multiprocessing

        self.count = count
        self.host, self.port = host, port
        self.secret = secret
        self.folder = folder
        self.base_dir = base_dir
        self.health = health
        self.limits = limits or Limits()
        self.slots: list[_Worker | None] = [None] * count
        self.restarts = 0  # workers started again after one died
        self.generation = 0  # the last snapshot written for the workers
        self._ctx = multiprocessing.get_context("spawn")
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._pending: Snapshot | None = None
        self._writer: asyncio.Task[None] | None = None
        self._cluster: object | None = None  # the cluster last written (held: its id is compared)
        self._cluster_generation = 0

    @property
    def pids(self) -> list[int]:
        """The workers that listen now (started, not ended)."""
        return [w.pid for w in self.slots if w is not None and w.listening and w.process.exitcode is None]

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start every worker and wait until each listens; ``WorkerStartError`` (all stopped again) if one cannot."""
        make_private_dirs(self.folder)
        await asyncio.to_thread(_check_free, self.host, self.port)
        results = await asyncio.gather(*(self._spawn(i) for i in range(self.count)), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.stop()
            raise failed[0]
        self._tasks = [asyncio.create_task(self._keep(i), name=f"live-worker-{i}") for i in range(self.count)]
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="live-heartbeat"))
        log.info("%d live worker processes answer http://%s:%d (pids %s)", self.count, self.host, self.port,
                 ", ".join(map(str, self.pids)))

    async def stop(self) -> None:
        """Stop every worker (asked, then SIGTERM, then SIGKILL, by PID) and remove the snapshot files."""
        self._stopping = True
        tasks = [*self._tasks, *([self._writer] if self._writer is not None else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks, self._writer = [], None
        workers = [w for w in self.slots if w is not None]
        for w in workers:
            self._send(w, ("stop",))
        await asyncio.gather(*(self._end(w) for w in workers))
        for name in (CLUSTER_FILE, SNAPSHOT_FILE):
            with contextlib.suppress(OSError):
                (self.folder / name).unlink()

    async def _spawn(self, slot: int) -> _Worker:
        loop = asyncio.get_running_loop()
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=serve, name=f"reconciler-live-{slot}", daemon=True,
                                    args=(child, slot, self.host, self.port, self.base_dir, str(self.folder),
                                          logging.getLogger().getEffectiveLevel(), self.limits))
        process.start()
        child.close()
        w = _Worker(slot, process, parent, time.monotonic(), loop.create_future(), asyncio.Queue(), process.pid or 0)
        self.slots[slot] = w  # from here on ``stop`` ends it, whatever happens below
        loop.add_reader(parent.fileno(), self._on_reply, w)
        ok, _ = self.health()
        generation = self.generation
        # The secret over the pipe: never on a command line, in the environment or in a file.
        self._send(w, ("start", self.secret, generation, ok))
        try:
            reply = await asyncio.wait_for(asyncio.shield(w.ready), READY_TIMEOUT)
        except TimeoutError:
            raise WorkerStartError(0, f"live worker {slot} did not start within {READY_TIMEOUT:.0f}s") from None
        if reply[0] == "error":
            raise WorkerStartError(reply[1], reply[2])
        if reply[0] != "ready":
            raise WorkerStartError(0, f"live worker {slot} ended while starting (exit status {process.exitcode})")
        if self.generation > generation:  # a snapshot written while it started
            self._send(w, ("snapshot", self.generation))
        return w

    async def _keep(self, slot: int) -> None:
        """Watch the worker in ``slot``; when it dies, log it and start another after a backoff."""
        failures = 0
        while not self._stopping:
            w = self.slots[slot]
            if w is not None:
                await self._ended(w)
                if self._stopping:
                    return
                lived, pid, status = time.monotonic() - w.started, w.pid, _exit_status(w.process.exitcode)
                self._discard(w)
                self.slots[slot] = None
                if lived > STABLE_AFTER:
                    failures = 0
                log.error("live worker %d (pid %d) %s after %.0fs; starting another", slot, pid, status, lived)
            failures += 1
            await asyncio.sleep(RESTART_BACKOFF.wait(failures))
            self.restarts += 1
            try:
                w = await self._spawn(slot)
            except Exception as exc:  # noqa: BLE001 — a keeper never gives up: the next try comes after a longer wait
                why = exc.strerror if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
                log.error("live worker %d could not start again: %s; trying again in %.1fs", slot, why,
                          RESTART_BACKOFF.wait(failures + 1))
                failed = self.slots[slot]
                if failed is not None:
                    await self._end(failed)
                continue
            log.info("live worker %d started again (pid %d)", slot, w.pid)

    async def _ended(self, w: _Worker) -> None:
        """Wait until the worker's process has ended (its sentinel becomes readable)."""
        if w.closed or w.process.exitcode is not None:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        sentinel = w.process.sentinel

        def ended() -> None:
            if not done.done():
                done.set_result(None)

        loop.add_reader(sentinel, ended)
        try:
            if w.process.exitcode is None:
                await done
        finally:
            loop.remove_reader(sentinel)
        w.process.join(1)

    async def _end(self, w: _Worker) -> None:
        """End one worker: it was asked to stop; SIGTERM after ``STOP_TIMEOUT``, SIGKILL after 2 s more."""
        if w.closed:
            return
        for escalate in (None, w.process.terminate, w.process.kill):
            if escalate is not None:
                if w.process.exitcode is not None:
                    break
                log.warning("live worker %d (pid %d) did not stop: %s", w.slot, w.pid,
                            "SIGTERM" if escalate == w.process.terminate else "SIGKILL")
                escalate()
            try:
                await asyncio.wait_for(self._ended(w), STOP_TIMEOUT if escalate is None else 2.0)
                break
            except TimeoutError:
                continue
        self._discard(w)
        if self.slots[w.slot] is w:
            self.slots[w.slot] = None

    def _discard(self, w: _Worker) -> None:
        """Forget an ended worker: its pipe closed, its process object released (it was reaped)."""
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(w.conn.fileno())
        w.conn.close()
        if not w.ready.done():
            w.ready.set_result(("eof",))
        w.closed = True
        with contextlib.suppress(ValueError):
            w.process.close()  # ValueError: still running (not asked of ``_discard``'s callers)

    # ------------------------------------------------------------------ messages

    def _send(self, w: _Worker, message: tuple[Any, ...]) -> bool:
        try:
            w.conn.send(message)
            return True
        except (OSError, ValueError):  # it died (its keeper restarts it) or was discarded
            return False

    def _on_reply(self, w: _Worker) -> None:
        try:
            while w.conn.poll():
                message = w.conn.recv()
                w.heard = time.monotonic()
                if message[0] == "alive":
                    continue
                if message[0] in ("ready", "error"):
                    if not w.ready.done():
                        w.ready.set_result(message)
                else:
                    w.replies.put_nowait(message)
        except (EOFError, OSError, ValueError):  # the worker ended: its keeper notices by its sentinel
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(w.conn.fileno())
            if not w.ready.done():
                w.ready.set_result(("eof",))
            w.replies.put_nowait(None)

    async def _heartbeat(self) -> None:
        """The loop's health to every worker, once a second; each answers, and one that stops answering (hung:
        alive but deaf, so it would never be restarted) is killed — its keeper starts another."""
        while True:
            ok, _ = self.health()
            now = time.monotonic()
            for w in self.slots:
                if w is None or not w.listening:
                    continue
                if now - max(w.heard, w.started) > HUNG_AFTER and w.process.exitcode is None:
                    log.error("live worker %d (pid %d) has not answered for %.0fs: killing it", w.slot, w.pid,
                              now - max(w.heard, w.started))
                    w.process.kill()
                    continue
                self._send(w, ("health", ok))
            await asyncio.sleep(HEARTBEAT)

    async def stats(self, timeout: float = 5.0) -> list[WorkerStats]:
        """What each running worker says of itself."""
        out = []
        for w in list(self.slots):
            if w is None or not w.listening or not self._send(w, ("stats",)):
                continue
            with contextlib.suppress(TimeoutError):
                while (reply := await asyncio.wait_for(w.replies.get(), timeout)) is not None:
                    if reply[0] == "stats":
                        out.append(WorkerStats(w.slot, reply[1], reply[2], reply[3]))
                        break
        return out

    # ------------------------------------------------------------------ snapshots

    def publish(self, snapshot: Snapshot) -> None:
        """Hand ``snapshot`` to every worker (written in a thread; the newest wins when the writer is behind)."""
        self._pending = snapshot
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_pending(), name="live-publish")

    async def _write_pending(self) -> None:
        while self._pending is not None and not self._stopping:
            snapshot, self._pending = self._pending, None
            try:
                generation = await asyncio.to_thread(self._write, snapshot)
            except Exception:  # the workers keep the last snapshot they have; the next interval tries again
                log.exception("cannot hand the snapshot to the live workers")
                continue
            for w in self.slots:
                if w is not None and w.listening:
                    self._send(w, ("snapshot", generation))

    def _write(self, snapshot: Snapshot) -> int:
        """The snapshot's inputs into the state folder: the cluster (only when it changed), then the rest."""
        cluster = snapshot.cluster
        if cluster is not self._cluster:
            self._cluster_generation += 1
            data = pickle.dumps((self._cluster_generation, cluster), protocol=pickle.HIGHEST_PROTOCOL)
            write_atomic(self.folder / CLUSTER_FILE, sealed(file_key(self.secret, CLUSTER_FILE), data), 0o600, sync=False)
            self._cluster = cluster
        generation = self.generation + 1
        data = pickle.dumps((generation, self._cluster_generation, snapshot_fields(snapshot)),
                            protocol=pickle.HIGHEST_PROTOCOL)
        write_atomic(self.folder / SNAPSHOT_FILE, sealed(file_key(self.secret, SNAPSHOT_FILE), data), 0o600, sync=False)
        self.generation = generation
        return generation


def _check_free(host: str, port: int) -> None:
    """Bind the port once without SO_REUSEPORT (``OSError`` if that fails): the workers' SO_REUSEPORT would
    otherwise join any other listener of this user's on it — a second `reconciler run` — and share its traffic,
    where one process alone fails to bind."""
    import socket

    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listener: TIME_WAIT is no obstacle
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)


def snapshot_fields(snapshot: Snapshot) -> dict[str, Any]:
    """What makes a snapshot besides its cluster (its per-snapshot memo starts empty in the worker)."""
    return {f.name: getattr(snapshot, f.name) for f in dataclasses.fields(snapshot) if f.init and f.name != "cluster"}


def _exit_status(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def file_key(secret: Secret, name: str) -> bytes:
    """The HMAC key of one of the files the loop's process hands the workers (its own per file)."""
    return secret.derive("live-worker-file", name)


def _read_ours(path: Path, key: bytes) -> Any:
    """Unpickle a file this service wrote: only if it is ours, nobody else may write it, and its HMAC under ``key``
    matches (``MacMismatch`` if not: then nothing of it is unpickled)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"{path} is not ours alone (owner {st.st_uid}, mode {st.st_mode & 0o777:04o}): not read")
        content = f.read()
    return pickle.loads(unsealed(key, content, str(path)))


# ---------------------------------------------------------------------- the worker process


def serve(conn: Connection, slot: int, host: str, port: int, base_dir: str, folder: str, level: int,
          limits: Limits) -> None:
    """A worker process's entry point (spawned): answer the public port until told to stop or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the loop stops us in order
    handler = logging.StreamHandler(sys.stderr)  # escaped as the loop's own lines are (clients' text is in them)
    handler.setFormatter(PrintableFormatter(f"%(asctime)s %(levelname)-7s live[{slot}] %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    try:
        kind, secret, generation, healthy = conn.recv()
    except EOFError:
        return
    assert kind == "start"
    worker = _Serving(conn, slot, secret, Path(folder), base_dir, limits, healthy)
    try:
        import uvloop  # as `reconciler run` does
    except ImportError:
        code = asyncio.run(worker.run(host, port, generation))
    else:
        code = uvloop.run(worker.run(host, port, generation))
    sys.exit(code)


class _Serving:
    """Inside a worker: the public listener over this process's copy of the snapshot."""

    def __init__(self, conn: Connection, slot: int, secret: Secret, folder: Path, base_dir: str, limits: Limits,
                 healthy: bool):
        from prometheus_client import CollectorRegistry

        from reconciler.loop.http import HttpOutlet

        self.conn = conn
        self.slot = slot
        self.secret = secret
        self.keys = {name: file_key(secret, name) for name in (CLUSTER_FILE, SNAPSHOT_FILE)}
        self.folder = folder
        self.base_dir = base_dir
        self.limits = limits
        self.answers = LiveAnswers(secret, Tokens(secret))
        self.outlet = HttpOutlet(self.answers, CollectorRegistry(), lambda: None, self.health)
        self.listener: Guards | None = None
        self.generation = 0
        self.cluster: Any = None
        self.cluster_generation = 0
        self._geoip: tuple[str | None, Callable[[str], str | None] | None] = (None, None)
        self._wanted = 0
        self._loader: asyncio.Task[None] | None = None
        self._load_error = ""
        self._healthy, self._heard = healthy, time.monotonic()
        self.stop = asyncio.Event()

    def health(self) -> tuple[bool, str]:
        if self._load_error:
            return False, self._load_error
        if time.monotonic() - self._heard > HEALTH_FRESH:
            return False, "no word from the loop's process"
        return self._healthy, "as the loop's process says"

    async def run(self, host: str, port: int, generation: int) -> int:
        loop = asyncio.get_running_loop()
        if generation:
            try:
                self._install(*await asyncio.to_thread(self._load))
            except MacMismatch as exc:  # one line: what was refused is in it; nothing of it was unpickled
                log.error("%s; not starting", exc)
                self.conn.send(("error", 0, f"live worker {self.slot}: {exc}"))
                return 4
            except Exception as exc:  # told to the loop's process, which logs it and tries again later
                log.exception("cannot load the snapshot")
                self.conn.send(("error", 0, f"live worker {self.slot} cannot load the snapshot: {type(exc).__name__}: {exc}"))
                return 4
        self.listener = self.outlet.fast_public(self.limits)  # the per-client cap: as the loop's
        try:
            await self.listener.start(host, port, reuse_port=True)
        except OSError as exc:
            self.conn.send(("error", exc.errno or 0, exc.strerror or str(exc)))
            return 3
        loop.add_reader(self.conn.fileno(), self._on_message)
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        self.conn.send(("ready", os.getpid()))
        await self.stop.wait()
        loop.remove_reader(self.conn.fileno())
        if self._loader is not None:
            self._loader.cancel()
        await self.listener.stop()
        return 0

    def _on_message(self) -> None:
        try:
            while self.conn.poll():
                message = self.conn.recv()
                kind = message[0]
                if kind == "health":
                    self._healthy, self._heard = bool(message[1]), time.monotonic()
                    self.conn.send(("alive",))
                elif kind == "snapshot":
                    self._wanted = max(self._wanted, int(message[1]))
                    if self._loader is None or self._loader.done():
                        self._loader = asyncio.create_task(self._load_wanted())
                elif kind == "stats":
                    served = self.listener.served if self.listener is not None else 0
                    self.conn.send(("stats", os.getpid(), served, self.generation))
                elif kind == "stop":
                    self.stop.set()
        except (EOFError, OSError):  # the loop's process is gone: nobody feeds or stops us any more
            log.warning("the loop's process is gone: stopping")
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            self.stop.set()

    async def _load_wanted(self) -> None:
        while self._wanted > self.generation:
            try:
                self._install(*await asyncio.to_thread(self._load))
            except MacMismatch as exc:  # one line: what was refused is in it; nothing of it was unpickled
                log.error("%s; answering from snapshot %d until the next one", exc, self.generation)
                self._load_error = "cannot load the snapshot: its file was not written by this service"
                return
            except Exception as exc:  # keep answering from the last snapshot; /healthz says why
                log.exception("cannot load snapshot %d", self._wanted)
                self._load_error = f"cannot load the snapshot: {type(exc).__name__}"
                return

    def _load(self) -> tuple[int, Snapshot, int, Tokens | None, Callable[[str], str | None] | None]:
        """(generation, snapshot, cluster generation, a token index for a new cluster, a region lookup) from the
        files; in a thread — the listener goes on answering from the current snapshot meanwhile."""
        for _ in range(50):
            generation, cluster_generation, fields = _read_ours(self.folder / SNAPSHOT_FILE, self.keys[SNAPSHOT_FILE])
            cluster, tokens = self.cluster, None
            if cluster_generation != self.cluster_generation:
                written, cluster = _read_ours(self.folder / CLUSTER_FILE, self.keys[CLUSTER_FILE])
                if written != cluster_generation:  # the loop's process is replacing both files: read them again
                    time.sleep(0.05)
                    continue
                tokens = Tokens(self.secret)
                tokens.index(cluster)  # here, not on the listener's thread (one HMAC per user)
            snapshot = Snapshot(cluster=cluster, **fields)
            if cluster.users:  # the shared memos, here too
                decide(snapshot, cluster.users[0].name)
            return generation, snapshot, cluster_generation, tokens, self._region_lookup(cluster)
        raise RuntimeError("the snapshot and cluster files kept changing under the reader")

    def _install(self, generation: int, snapshot: Snapshot, cluster_generation: int, tokens: Tokens | None,
                 region_of: Callable[[str], str | None] | None) -> None:
        from reconciler.loop.client_address import networks

        if tokens is not None:
            self.answers.tokens = tokens
            self.cluster, self.cluster_generation = snapshot.cluster, cluster_generation
            self.outlet.trusted_proxies = networks(snapshot.cluster.settings.outputs.trusted_proxies)
            self.outlet.region_of = region_of
        self.answers.publish(snapshot)
        self.generation = generation
        self._load_error = ""

    def _region_lookup(self, cluster: Any) -> Callable[[str], str | None] | None:
        """The GeoIP database's lookup, opened again only when its setting changes (as ``Loop._region_lookup``)."""
        db = cluster.settings.steering.geoip_database
        if db == self._geoip[0]:
            return self._geoip[1]
        from reconciler.balance.geoip import region_lookup

        lookup = region_lookup(self.base_dir, db, log.error)
        self._geoip = (db, lookup)
        return lookup
