"""Standby controllers: who leads, by a lease in etcd, and the learned state the leader hands over.

Several ``reconciler run`` processes (on different machines, each with its own checkout of the same git
repository) name the same etcd in ``settings.leader.etcd``. Exactly one leads: it collects, plans and
applies, and publishes its learned state after every interval; the others are standbys: they read that
state and serve subscriptions from it (read-only: no collection, no SSH, no apply).

**Election** (``Election``). A campaign grants a lease of ``settings.leader.lease`` seconds and, in one
transaction, creates ``<prefix>/leader`` (``create_revision == 0``) holding this process's identity
(host, pid, a random part) on that lease. The winner's **fence** is the key's create revision: etcd's
revision only grows, so every later leader's fence is higher than every earlier one's. The leader keeps the
lease alive every third of the lease and checks that the key is still its own (value and create revision);
a failed keepalive, an expired lease or a key gone or someone else's ends its leadership at once. It also
counts itself the leader only until ``sent + lease - margin`` of its last successful keepalive (monotonic
clock), so a process that was stopped (SIGSTOP, a frozen VM) or cut off knows it is not the leader any more
the moment it runs again, before it hears from etcd — ``is_leader`` is that deadline check. A standby looks
at the key every quarter of the lease and campaigns when it is gone: a dead leader is replaced within the
lease plus a quarter (the lease ends at most one lease after its last keepalive).

**Fencing**. Every apply the leader makes carries its fence (``reconciler.plan.lock.Fence``); each server
keeps the highest fence it accepted and refuses a lower one under its apply lock, before any file changes
(``reconciler.engine.scripts.lock``). A deposed leader that wakes up mid-apply is refused by every server
a newer leader has touched, and stops by itself before its next step anywhere else.

**Handover** (``StateChannel``). The leader publishes ``Learned.to_bytes`` (compressed) with the state
folder's ``managed.json`` and ``facts.json`` after each interval: in chunks under
``<prefix>/state/g/<generation>/<i>`` (etcd refuses requests over 1.5 MiB), then the pointer
``<prefix>/state/current``, then older generations are deleted — each write a transaction guarded by "the
leader key still holds my identity at my fence", so a deposed leader can never overwrite its successor's
state. A reader reads the pointer and then the chunks at the pointer's revision: a consistent copy, or
none (it tries again next interval). The pointer carries the state's HMAC under a key derived from the master
secret (and the generation): a reader takes only a state a controller with the same secret published, at most
``MAX_PUBLISHED_BYTES`` long — anyone else who can write to etcd cannot hand the standbys a state.

etcd is reached through ``etcd3gw`` (its v3 JSON gateway over HTTP; etcd 3.4 or later); its calls block,
so each of ``Election`` and ``StateChannel`` runs them in a thread of its own — a large state upload never
delays a keepalive.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import math
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from reconciler.credentials import Secret, read_credential
from reconciler.errors import SecretError
from reconciler.fleet.learned import MAX_STATE_BYTES
from reconciler.model.cluster import LeaderSettings
from reconciler.state.files import Mac, mac_matches

log = logging.getLogger("reconciler.leader")
T = TypeVar("T")

MIN_TTL = 2  # etcd's shortest lease with its default heartbeat (shorter ones are granted as this long anyway)
CHUNK = 1_000_000  # bytes of state per etcd request (its default limit is 1.5 MiB, base64 in JSON adds a third)
API_PATH = "/v3/"  # the gateway of etcd 3.4 and later
BUNDLE_MAGIC = b"RSB1"
MAX_PUBLISHED_BYTES = MAX_STATE_BYTES  # a published state (compressed, with managed.json and facts.json) is far less
# What a call to etcd may raise: etcd3gw's errors, the HTTP client's (requests' are OSErrors), a malformed answer.
EtcdFailure = (Etcd3Exception, OSError, ValueError, KeyError, TypeError)


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def failure(exc: BaseException) -> str:
    """One line for an etcd failure: etcd's own message (etcd3gw keeps the answer's body in ``detail_text`` and
    only the HTTP reason in the exception's text), then that reason."""
    text = str(exc)
    detail = getattr(exc, "detail_text", None)
    if isinstance(detail, str) and detail.strip():
        try:
            said = json.loads(detail)
            message = str(said.get("message") or said.get("error") or detail) if isinstance(said, dict) else detail
        except ValueError:
            message = detail
        text = f"{message.strip()} ({text})" if text and text not in message else message
    return f"{type(exc).__name__}: {text.strip()[:300]}"


def default_identity() -> str:
    """``host:pid:random``: two processes (or one restarted) never share it."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


# --------------------------------------------------------------------------- etcd, through etcd3gw


class Etcd:
    """The etcd endpoints of ``settings.leader``: each call goes to the endpoint that answered last, and on a
    connection failure to the next (a cluster of etcd members behind several URLs). Blocking: call it in a
    thread. With a user, it authenticates (``/v3/auth/authenticate``) and sends the token; a refused token
    is renewed once."""

    def __init__(self, endpoints: list[str], timeout: float, *, ca: str | None = None, cert: str | None = None,
                 key: str | None = None, username: str | None = None, password: str | None = None):
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.clients: list[Etcd3Client] = []
        for url in endpoints:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{url!r} is not an etcd client URL (http://host:port or https://host:port)")
            port = parts.port or 2379
            self.clients.append(Etcd3Client(parts.hostname, port, parts.scheme, ca_cert=ca, cert_key=key, cert_cert=cert,
                                            timeout=timeout, api_path=API_PATH))
        self.username, self.password = username, password
        self._current = 0
        self._tokens: dict[int, str] = {}

    @classmethod
    def from_settings(cls, settings: LeaderSettings, base_dir: str, timeout: float) -> Etcd:
        """The endpoints, TLS files (relative to the cluster file's folder) and the user's password (``SecretError``
        when a user is named and no password is found)."""

        def path(p: str | None) -> str | None:
            return None if p is None else os.path.join(base_dir, os.path.expanduser(p))

        password = None
        if settings.username:
            raw, where = read_credential(settings.password_env, settings.password_file, "etcd password")
            if not raw:
                raise SecretError(f"settings.leader.username is {settings.username!r} but {where} holds no password")
            password = raw.decode(errors="replace")
        tls = settings.tls
        return cls(list(settings.etcd), timeout, ca=path(tls.ca) if tls else None, cert=path(tls.cert) if tls else None,
                   key=path(tls.key) if tls else None, username=settings.username, password=password)

    def _authenticate(self, i: int, client: Etcd3Client) -> None:
        if self.username is None:
            return
        client.session.headers.pop("Authorization", None)  # a stale token is refused even here
        got = client.post(client.get_url("/auth/authenticate"), json={"name": self.username, "password": self.password})
        self._tokens[i] = str(got["token"])
        client.session.headers["Authorization"] = self._tokens[i]

    def call(self, fn: Callable[[Etcd3Client], T]) -> T:
        """``fn(client)`` on the first endpoint that answers."""
        n = len(self.clients)
        last: Exception | None = None
        for k in range(n):
            i = (self._current + k) % n
            client = self.clients[i]
            try:
                if self.username is not None and i not in self._tokens:
                    self._authenticate(i, client)
                try:
                    out = fn(client)
                except Etcd3Exception as exc:
                    said = failure(exc).lower()
                    if self.username is None or not ("token" in said or "user name is empty" in said):
                        raise
                    self._authenticate(i, client)  # an expired or revoked token (etcd restarted): once more
                    out = fn(client)
                self._current = i
                return out
            except (ConnectionFailedError, ConnectionTimeoutError, OSError) as exc:
                last = exc  # the next endpoint
        assert last is not None
        raise last

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
            otherwise: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One transaction: ``success`` when every comparison holds, else ``otherwise``."""
        payload = {"compare": compare, "success": success, "failure": otherwise or []}
        return dict(self.call(lambda c: c.transaction(payload)))

    def range(self, key: str, **options: Any) -> dict[str, Any]:
        """The raw range answer (``header.revision`` and ``kvs``, values base64)."""
        payload = {"key": _b64(key), **options}
        return dict(self.call(lambda c: c.post(c.get_url("/kv/range"), json=payload)))

    def grant(self, ttl: int) -> tuple[int, int]:
        """(lease id, granted TTL)."""
        got = self.call(lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": ttl, "ID": 0}))
        return int(got["ID"]), int(got.get("TTL", ttl))

    def keepalive(self, lease: int) -> int:
        """The lease's TTL after the renewal; -1 when it has expired (or was revoked)."""
        got = self.call(lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": lease}))
        return int(got.get("result", {}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        self.call(lambda c: c.post(c.get_url("/kv/lease/revoke"), json={"ID": lease}))


def _range_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return _b64(bytes(raw))


# --------------------------------------------------------------------------- the election


class Election:
    """One controller's part in the election; ``run(stop)`` is its task (``role.Elected`` runs it on an event loop
    of its own, in a thread). ``on_change(leading)`` is called on that event loop when it starts or stops leading,
    after ``is_leader`` says so."""

    def __init__(self, etcd: Etcd, prefix: str, lease: float, identity: str | None = None,
                 on_change: Callable[[bool], None] | None = None):
        self.etcd = etcd
        self.prefix = prefix.rstrip("/")
        self.key = f"{self.prefix}/leader"
        self.ttl = max(MIN_TTL, math.ceil(lease))
        self.identity = identity or default_identity()
        self.on_change = on_change
        self.fence = 0  # the create revision of our leader key while (and after) we lead; 0 before
        self.leader = ""  # who leads, as last seen ("" unknown or nobody)
        self.since = time.time()  # when the current role began
        self.error = ""  # the last failure to reach etcd ("" after a success)
        self.elections = 0  # how often this process won
        self._lease: int | None = None
        self._valid_until = 0.0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="etcd-election")

    # ------------------------------------------------------------------ what the loop reads

    @property
    def margin(self) -> float:
        """How long before the lease could end (by our clock) we stop counting ourselves the leader."""
        return max(0.5, self.ttl / 10)

    @property
    def is_leader(self) -> bool:
        """Leading now: elected, and the lease renewed recently enough that it cannot have ended."""
        return self._lease is not None and time.monotonic() < self._valid_until

    def guard(self) -> list[dict[str, Any]]:
        """The comparisons that make a transaction ours only while we lead: the leader key holds our identity
        at our fence."""
        key = _b64(self.key)
        return [{"key": key, "result": "EQUAL", "target": "VALUE", "value": _b64(self.identity)},
                {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": self.fence}]

    def status(self) -> dict[str, Any]:
        leading = self.is_leader
        return {"role": "leader" if leading else "standby", "identity": self.identity,
                "leader": self.identity if leading else self.leader, "fence": self.fence if leading else 0,
                "lease_seconds": self.ttl, "since": self.since, "etcd_error": self.error}

    def describe(self) -> str:
        if self.is_leader:
            return f"leader (fence {self.fence}) since {time.strftime('%H:%M:%S', time.localtime(self.since))}"
        who = self.leader or "nobody yet"
        return f"standby (leader: {who})" + (f"; etcd: {self.error}" if self.error else "")

    # ------------------------------------------------------------------ the task

    async def _io(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def run(self, stop: asyncio.Event) -> None:
        """Campaign or keep leading until ``stop``."""
        while not stop.is_set():
            wait = await (self._lead() if self._lease is not None else self._follow())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)

    async def _follow(self) -> float:
        """A standby's round: who leads; nobody → campaign. Returns how long to wait before the next round."""
        poll = self.ttl / 4
        try:
            got = await self._io(lambda: self.etcd.range(self.key))
            kvs = got.get("kvs") or []
            if kvs:
                self.leader = _unb64(kvs[0].get("value", "")).decode(errors="replace")
                self._ok()
                return poll
            return poll if not await self._campaign() else self.ttl / 3
        except EtcdFailure as exc:
            self._failed(exc)
            return poll

    async def _campaign(self) -> bool:
        sent = time.monotonic()
        lease, ttl = await self._io(lambda: self.etcd.grant(self.ttl))
        key = _b64(self.key)
        try:
            got = await self._io(lambda: self.etcd.txn(
                [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
                [{"request_put": {"key": key, "value": _b64(self.identity), "lease": lease}}],
                [{"request_range": {"key": key}}]))
        except BaseException:
            with contextlib.suppress(*EtcdFailure):
                await self._io(lambda: self.etcd.revoke(lease))
            raise
        self._ok()
        if not got.get("succeeded"):
            with contextlib.suppress(*EtcdFailure):
                await self._io(lambda: self.etcd.revoke(lease))
            kvs = (got.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
            self.leader = _unb64(kvs[0].get("value", "")).decode(errors="replace") if kvs else ""
            return False
        # The fence and the count of wins before ``is_leader`` can say so: whoever sees this controller lead (from
        # another thread: ``role.Elected.run``) sees the fence it leads under and the takeover it owes
        self.fence = int(got["header"]["revision"])
        self.leader, self.since, self.elections = self.identity, time.time(), self.elections + 1
        self._lease, self._valid_until = lease, sent + min(ttl, self.ttl) - self.margin
        log.warning("leading: elected in etcd as %s (fence %d, lease %ds)", self.identity, self.fence, self.ttl)
        self._changed(True)
        return True

    async def _lead(self) -> float:
        """A leader's round: renew the lease, check the key is still ours."""
        assert self._lease is not None
        lease = self._lease
        sent = time.monotonic()
        if sent >= self._valid_until:
            return await self._step_down("the lease may have ended: no renewal for "
                                         f"{sent - self._valid_until + self.ttl - self.margin:.1f}s")
        try:
            ttl = await self._io(lambda: self.etcd.keepalive(lease))
            if ttl <= 0:
                return await self._step_down("the lease has ended (etcd let it expire)", revoke=False)
            mine = await self._io(lambda: self.etcd.txn(self.guard(), []))
        except EtcdFailure as exc:
            self._failed(exc)
            left = self._valid_until - time.monotonic()
            if left <= 0:
                return await self._step_down(f"cannot renew the lease: {self.error}")
            return min(max(0.1, self.ttl / 10), left)
        self._ok()
        if not mine.get("succeeded"):
            return await self._step_down("the leader key is gone or someone else's")
        if self._lease == lease:
            self._valid_until = max(self._valid_until, sent + min(ttl, self.ttl) - self.margin)
        return self.ttl / 3

    async def _step_down(self, why: str, revoke: bool = True) -> float:
        lease, self._lease = self._lease, None
        self.since = time.time()
        self.leader = ""
        log.warning("no longer the leader (fence %d): %s — standby now: no collection, plan or apply from this "
                    "controller", self.fence, why)
        self._changed(False)
        if revoke and lease is not None:  # if it still exists: let the others campaign now, not at its end
            with contextlib.suppress(*EtcdFailure):
                await self._io(lambda: self.etcd.revoke(lease))
        return 0.0 if not revoke else self.ttl / 4

    def _changed(self, leading: bool) -> None:
        if self.on_change is not None:
            try:
                self.on_change(leading)
            except Exception:  # the loop's reaction failing must not stop the election
                log.exception("reacting to the leadership change failed")

    def _ok(self) -> None:
        if self.error:
            log.info("etcd answers again")
        self.error = ""

    def _failed(self, exc: BaseException) -> None:
        text = failure(exc)
        if text != self.error:
            log.warning("etcd: %s", text)
        self.error = text

    async def resign(self) -> None:
        """Give up leading now (a clean stop): the lease is revoked, the key goes with it and a standby
        campaigns at its next look instead of waiting for the lease to end."""
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                await asyncio.wait_for(self._io(lambda: self.etcd.revoke(lease)), self.ttl)
                log.info("resigned the leadership (fence %d)", self.fence)
            except (TimeoutError, *EtcdFailure) as exc:
                log.warning("could not resign the leadership (the lease ends by itself in %ds): %s", self.ttl, failure(exc))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------- the learned state, handed over


def pack(learned: bytes, extras: dict[str, Any]) -> bytes:
    """One blob: the learned state (``Learned.to_bytes``) and the small JSON documents beside it."""
    head = json.dumps(extras, sort_keys=True).encode()
    return BUNDLE_MAGIC + struct.pack(">I", len(head)) + head + learned


def unpack(blob: bytes) -> tuple[bytes, dict[str, Any]]:
    if blob[:4] != BUNDLE_MAGIC or len(blob) < 8:
        raise ValueError("not a published state (bad magic)")
    (n,) = struct.unpack(">I", blob[4:8])
    extras = json.loads(blob[8:8 + n])
    if not isinstance(extras, dict):
        raise ValueError("not a published state (extras)")
    return blob[8 + n:], extras


@dataclass
class Published:
    """A state read back: its pointer (generation, by whom, fence, when, ticks) and its blob."""

    pointer: dict[str, Any]
    blob: bytes

    @property
    def generation(self) -> str:
        return str(self.pointer.get("generation", ""))


def generation_order(generation: str) -> tuple[int, ...]:
    """A generation's place in time (``<fence>-<seq>``, as ``publish`` names it); unknown forms sort first."""
    try:
        return tuple(int(x) for x in generation.split("-"))
    except ValueError:
        return ()


class ChannelBase:
    """What every channel of the learned state shares: generations named ``<fence>-<seq>``, each blob under an HMAC
    keyed from the master secret and the generation, replays of an older generation refused, and the blocking
    ``publish_sync``/``read_sync`` a subclass writes run in one thread of its own."""

    def __init__(self, secret: Secret, thread: str):
        self._key = secret.derive("published-learned-state")
        self._seq = 0
        self._newest: str | None = None  # the newest generation read: an older one is a replay, refused
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=thread)

    def _generation_key(self, generation: str) -> bytes:
        """The HMAC key of one generation: a state published as one generation is refused as any other."""
        return hmac.digest(self._key, generation.encode(), "sha256")

    def _next_generation(self, fence: int, blob: bytes) -> tuple[str, str]:
        """(the name of the next generation this channel writes, the HMAC of ``blob`` as it); a blob over what a
        standby reads is refused here."""
        if len(blob) > MAX_PUBLISHED_BYTES:
            raise ValueError(f"the learned state is {len(blob)} bytes, more than the {MAX_PUBLISHED_BYTES} a standby "
                             "reads: not published")
        self._seq += 1
        generation = f"{fence:016d}-{self._seq:010d}"
        mac = Mac(self._generation_key(generation))
        mac.update(blob)
        return generation, mac.hexdigest()

    def publish_sync(self, guard: list[dict[str, Any]], fence: int, blob: bytes, meta: dict[str, Any]) -> str | None:
        raise NotImplementedError

    def read_sync(self, known: str | None = None) -> Published | None:
        raise NotImplementedError

    async def publish(self, guard: list[dict[str, Any]], fence: int, blob: bytes, meta: dict[str, Any]) -> str | None:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.publish_sync, guard, fence, blob, meta)

    async def read(self, known: str | None = None) -> Published | None:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.read_sync, known)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class StateChannel(ChannelBase):
    """The leader's learned state in etcd: ``publish`` (guarded by the election) and ``read``, authenticated with
    an HMAC keyed from the master secret (leader and standby hold the same secret; etcd never does)."""

    def __init__(self, etcd: Etcd, prefix: str, secret: Secret, chunk: int = CHUNK):
        super().__init__(secret, "etcd-state")
        self.etcd = etcd
        self.prefix = prefix.rstrip("/")
        self.pointer = f"{self.prefix}/state/current"
        self.chunks = f"{self.prefix}/state/g/"
        self.chunk = chunk

    def _chunk_key(self, generation: str, i: int) -> str:
        return f"{self.chunks}{generation}/{i:06d}"

    def publish_sync(self, guard: list[dict[str, Any]], fence: int, blob: bytes, meta: dict[str, Any]) -> str | None:
        """Write ``blob`` as a new generation; its name, or None when the guard failed (no longer the leader)."""
        generation, mac = self._next_generation(fence, blob)
        parts = [blob[i:i + self.chunk] for i in range(0, len(blob), self.chunk)] or [b""]
        for i, part in enumerate(parts):
            got = self.etcd.txn(guard, [{"request_put": {"key": _b64(self._chunk_key(generation, i)), "value": _b64(part)}}])
            if not got.get("succeeded"):
                return None
        pointer = {**meta, "generation": generation, "chunks": len(parts), "size": len(blob), "fence": fence,
                   "hmac": mac, "at": time.time()}
        older = [{"request_delete_range": {"key": _b64(self.chunks), "range_end": _b64(f"{self.chunks}{generation}")}}]
        got = self.etcd.txn(guard, [{"request_put": {"key": _b64(self.pointer), "value": _b64(json.dumps(pointer))}}, *older])
        return generation if got.get("succeeded") else None

    def read_sync(self, known: str | None = None) -> Published | None:
        """The newest published state, or None when there is none or it is ``known`` (the generation we have)."""
        got = self.etcd.range(self.pointer)
        kvs = got.get("kvs") or []
        if not kvs:
            return None
        pointer = json.loads(_unb64(kvs[0].get("value", "")))
        if not isinstance(pointer, dict) or str(pointer.get("generation")) == known:
            return None
        revision = int(got["header"]["revision"])
        generation, n, size, mac = str(pointer["generation"]), pointer["chunks"], pointer.get("size"), pointer.get("hmac")
        if not isinstance(mac, str):
            raise ValueError(f"published state {generation} carries no HMAC (a controller of an older version, or not "
                             "a controller, wrote it): refused")
        if self._newest is not None and generation_order(generation) < generation_order(self._newest):
            raise ValueError(f"published state {generation} is older than {self._newest}, which this controller already "
                             "read (a replay of an old state in etcd?): refused")
        if (not isinstance(size, int) or not isinstance(n, int) or not 0 <= size <= MAX_PUBLISHED_BYTES
                or n != max(1, -(-size // self.chunk))):
            raise ValueError(f"published state {generation} says it is {size} bytes in {n} chunks; a published state "
                             f"is at most {MAX_PUBLISHED_BYTES} bytes: refused")
        parts, got_bytes = [], 0
        for i in range(n):  # one request per chunk, all at the pointer's revision: a consistent copy
            part = self.etcd.range(self._chunk_key(generation, i), revision=revision).get("kvs") or []
            if not part:
                raise ValueError(f"published state {generation}: chunk {i} of {n} is missing")
            parts.append(_unb64(part[0].get("value", "")))
            got_bytes += len(parts[-1])
            if got_bytes > size:
                raise ValueError(f"published state {generation} holds more than the {size} bytes it says: refused")
        blob = b"".join(parts)
        if len(blob) != size or not mac_matches(self._generation_key(generation), blob, mac):
            raise ValueError(f"published state {generation}: its HMAC does not match (not published by a controller "
                             "with this master secret): refused; this controller keeps the state it has")
        self._newest = generation
        return Published(pointer, blob)


# --------------------------------------------------------------------------- metrics


class LeaderCollector(Collector):
    """``reconciler_leader{identity}`` 1 while this controller leads, else 0; ``reconciler_leader_fence``."""

    def __init__(self, election: Election):
        self.election = election

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        e = self.election
        leading = GaugeMetricFamily("reconciler_leader", "1 while this controller leads (settings.leader), 0 on a standby.",
                                    labels=["identity"])
        leading.add_metric([e.identity], 1.0 if e.is_leader else 0.0)
        yield leading
        yield GaugeMetricFamily("reconciler_leader_fence", "The fence (etcd revision) this controller's applies carry "
                                "while it leads; 0 on a standby.", value=float(e.fence if e.is_leader else 0))
