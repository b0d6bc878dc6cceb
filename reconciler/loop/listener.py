"""An HTTP listener that survives the internet: the guards (``Guards``) every listener of ours keeps, and the
aiohttp listener (``Listener``: aiohttp's low-level server) the operations pages use. The public listener on
its own is ``reconciler.loop.fastlistener``, with the same guards.

- **A connection cap**: past ``max_connections`` open connections a new one is closed at once
  (counted), so a flood cannot exhaust file descriptors that real clients need.
- **A cap per client**: past ``per_client`` open connections from one client (``client_address.connection_key``:
  its address, an IPv6 one by its /64; a trusted proxy is not capped so) its new ones are closed at once
  (counted), so one greedy client cannot take the connections every other client shares. Only a listener told
  the trusted proxies (``trusted_proxies``) caps per client.
- **Header and idle timeouts**: a connection must finish each request's headers within
  ``header_timeout`` of opening or of its previous response, and an idle keep-alive connection is
  closed after the same time (slowloris: 300 slow connections were held forever).
- **Quiet errors**: malformed requests are logged once per client address per minute, one line,
  no traceback (200 malformed requests logged 2,200 traceback lines).
- **Optional authentication** (``Credential``): a bearer token or basic credentials, compared in
  constant time; a wrong or missing one gets 401 with ``WWW-Authenticate``.

Who calls it: ``reconciler.loop.http.HttpOutlet``, once per listener (public and operations).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from reconciler.credentials import read_credential
from reconciler.errors import SecretError
from reconciler.loop.client_address import Network, connection_key
from reconciler.model.cluster import OperationsAuth

log = logging.getLogger("reconciler.http")
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Credential:
    """What the operations listener asks for: ``bearer`` (the token) or ``basic`` (``user:password``).
    ``repr`` never shows it."""

    kind: str
    value: str

    def __repr__(self) -> str:
        return f"Credential({self.kind}, <hidden>)"

    def accepts(self, header: str | None) -> bool:
        if not header:
            return False
        scheme, _, given = header.partition(" ")
        if self.kind == "bearer":
            return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.value.encode())
        if scheme.lower() != "basic":
            return False
        try:
            decoded = base64.b64decode(given.strip(), validate=True)
        except ValueError:
            return False
        return hmac.compare_digest(decoded, self.value.encode())

    @property
    def challenge(self) -> str:
        return 'Bearer realm="reconciler"' if self.kind == "bearer" else 'Basic realm="reconciler", charset="UTF-8"'


#: Connections one client may hold open at once (``Limits.per_client``). Not small: a carrier's NAT puts many users
#: behind one IPv4 address, and a load generator on one host (``bench/subscriptions.py``: 32) is one client too.
PER_CLIENT_CONNECTIONS = 64


@dataclass
class Limits:
    max_connections: int = 1024
    per_client: int = PER_CLIENT_CONNECTIONS
    # A peer on this host's loopback is a reverse proxy in front of the listener (nginx, Caddy) far more often than a
    # client: it is not capped per client unless this is off (tests: two loopback addresses as two clients).
    loopback_is_proxy: bool = True
    header_timeout: float = 10.0
    log_every: float = 60.0  # seconds between two log lines about one client's malformed requests


class _Connection:
    __slots__ = ("since", "busy", "client")

    def __init__(self, client: str | None) -> None:
        self.since = time.monotonic()  # opened, or its last response was sent
        self.busy = 0  # requests being answered
        self.client = client  # whose it is, for the cap per client (None: not capped so)


class Guards:
    """A listener's guards and counters, whatever speaks HTTP on it: the caps (``admit``/``release``), the sweep of
    slow and idle connections, the quiet log of malformed requests. ``open`` maps each open connection (its
    protocol object, which has a ``transport``) to its bookkeeping."""

    def __init__(self, name: str, limits: Limits | None = None,
                 trusted_proxies: Callable[[], tuple[Network, ...]] | None = None):
        self.name = name
        self.limits = limits or Limits()
        # Asked at each connection (a reload may change them). None: who is a proxy is not known here, so no cap per
        # client (it would cap a proxy's clients together); the cap on all connections holds.
        self.trusted_proxies = trusted_proxies
        self.open: dict[Any, _Connection] = {}
        self.by_client: dict[str, int] = {}  # open connections per client (connection_key)
        self.refused = 0  # connections closed at once: over a cap
        self.timed_out = 0  # connections closed for slow headers or idleness
        self.served = 0  # requests answered
        self._logged: dict[str, float] = {}
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        """Listen on (host, port); ``reuse_port``: share the port with other processes of ours that listen on it
        with the same option (SO_REUSEPORT: the kernel spreads new connections among them)."""
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    def _start_sweeper(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep(), name=f"{self.name}-sweeper")

    def _stop_sweeper(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.limits.header_timeout / 2))
            deadline = time.monotonic() - self.limits.header_timeout
            for proto, conn in list(self.open.items()):
                if not conn.busy and conn.since < deadline and proto.transport is not None:
                    self.timed_out += 1
                    proto.transport.close()

    def admit(self, proto: object, transport: asyncio.BaseTransport) -> bool:
        """Whether a new connection fits under both caps (then it is counted open), else it is counted refused."""
        client = None
        if self.trusted_proxies is not None:
            peer = transport.get_extra_info("peername")
            client = connection_key(str(peer[0]) if isinstance(peer, tuple) and peer else "", self.trusted_proxies(),
                                    self.limits.loopback_is_proxy)
        held = self.by_client.get(client, 0) if client is not None else 0
        if len(self.open) >= self.limits.max_connections or held >= self.limits.per_client:
            self.refused += 1
            return False
        if client is not None:
            self.by_client[client] = held + 1
        self.open[proto] = _Connection(client)
        return True

    def release(self, proto: object) -> None:
        conn = self.open.pop(proto, None)
        if conn is not None and conn.client is not None:
            left = self.by_client.pop(conn.client, 1) - 1
            if left > 0:
                self.by_client[conn.client] = left

    def malformed(self, peer: str, what: str, bug: BaseException | None = None) -> None:
        """One line per client per minute; ``bug``: not the client's fault, logged with its traceback."""
        now = time.monotonic()
        if now - self._logged.get(peer, -1e9) >= self.limits.log_every:
            self._logged[peer] = now
            if len(self._logged) > 10_000:  # forget the oldest clients rather than grow without bound
                for key in sorted(self._logged, key=self._logged.__getitem__)[:5_000]:
                    del self._logged[key]
            if bug is not None:
                log.error("%s listener: a request from %s failed: %s", self.name, peer, what[:200], exc_info=bug)
            else:
                log.warning("%s listener: malformed request from %s: %s (more from this client are not logged for %ds)",
                            self.name, peer, what[:200], int(self.limits.log_every))


class Listener(Guards):
    """One listening socket served by aiohttp: ``handle`` answers every request that arrives within the limits."""

    def __init__(self, name: str, handle: Handler, limits: Limits | None = None,
                 trusted_proxies: Callable[[], tuple[Network, ...]] | None = None):
        super().__init__(name, limits, trusted_proxies)
        self.handle = handle
        self._runner: web.ServerRunner | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        server = _Server(self, self._dispatch, access_log=None, keepalive_timeout=self.limits.header_timeout)
        self._runner = web.ServerRunner(server, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, reuse_address=True, reuse_port=reuse_port or None).start()
        self._start_sweeper()

    async def stop(self) -> None:
        self._stop_sweeper()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        self.served += 1
        conn = self.open.get(request.protocol)
        if conn is not None:
            conn.busy += 1
        try:
            return await self.handle(request)
        finally:
            if conn is not None:
                conn.busy -= 1
                conn.since = time.monotonic()


class _Handler(RequestHandler):
    """aiohttp's per-connection protocol, counted and watched by its ``Listener``."""

    listener: Listener

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self.listener.admit(self, transport):
            transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.listener.release(self)
        super().connection_lost(exc)

class _QuietLogger:
    """What aiohttp's request handler logs through: its errors about one request (a malformed request,
    TLS on a plain port, a handler's exception) become one line per client per minute, no traceback."""

    def __init__(self, listener: Listener):
        self.listener = listener

    def _one(self, msg: object, *args: Any, exc_info: object = None, **_: Any) -> None:
        peer = str(args[0]) if args and isinstance(args[0], str) else "unknown"
        what = str(msg) % args if args else str(msg)
        if isinstance(exc_info, BaseException):
            what = f"{what}: {type(exc_info).__name__}: {str(exc_info).strip()}"
        bug = isinstance(exc_info, Exception) and not isinstance(exc_info, HttpProcessingError | ConnectionError)
        self.listener.malformed(peer, what, exc_info if bug and isinstance(exc_info, Exception) else None)

    debug = info = warning = error = exception = _one


class _Unnamed(web.BaseRequest):
    """A request whose answer does not name the server: aiohttp adds ``Server: Python/3.x aiohttp/3.x`` to every
    response, which would tell a censor scanning for subscription endpoints what answers here."""

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        response.headers.popall("Server", None)


class _Server(web.Server):
    def __init__(self, listener: Listener, handler: Handler, **kwargs: Any):
        super().__init__(handler, **kwargs)
        self._listener = listener
        self._handler_kwargs = kwargs

    def _make_request(self, message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
        """Every request, an ill-formed one's error answer too, is one whose answer names no server."""
        return _Unnamed(message, payload, protocol, writer, task, self._loop)

    def __call__(self) -> RequestHandler:
        proto = _Handler(self, loop=self._loop, logger=_QuietLogger(self._listener),  # type: ignore[arg-type]
                         **self._handler_kwargs)
        proto.listener = self._listener
        return proto


def load_credential(auth: OperationsAuth | None) -> Credential | None:
    """The operations listener's credential from its environment variable or file (``SecretError`` saying
    where it was looked for); None when ``settings.outputs.operations_auth`` is not set."""
    if auth is None:
        return None
    raw, where = read_credential(auth.env, auth.file, "operations credential")
    value = raw.decode(errors="replace")
    if len(value) < 16 or (auth.kind == "basic" and ":" not in value):
        form = "user:password, the password at least 16 characters" if auth.kind == "basic" else "at least 16 characters"
        raise SecretError(f"the operations credential in {where} is missing or too short ({form}); "
                          "make one with `openssl rand -base64 24`")
    return Credential(auth.kind, value)
