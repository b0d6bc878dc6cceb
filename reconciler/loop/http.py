"""The loop's HTTP outlet (aiohttp, in the loop's own event loop, and the public listener).

The public listener (``settings.outputs.listen``) answers what ``reconciler.loop.public`` decides: subscriptions
(``/sub/<token>[/<format>]``) and a bare ``/healthz``. It runs on ``reconciler.loop.fastlistener`` (a compiled HTTP
parser and answers kept as encoded bytes); on aiohttp only when it shares its address with the operations pages.

Those two are all the public listener (``settings.outputs.listen``) serves. The
operations pages live on their own listener (``settings.outputs.operations_listen``,
loopback by default, optionally behind a bearer token or basic credentials):

- ``/metrics``: Prometheus exposition of the custom collector;
- ``/``, ``/server/<name>``, ``/user/<name>``, ``/users``, ``/routes``: the read-only console
  (``reconciler.console``) — the fleet, each server's and user's card, the topology coloured by health
  (ROUTE-8, HEALTH-13);
- ``/status.json``: the fleet's verdicts and routes as JSON.

With ``settings.outputs.workers`` above 1 the public side runs in worker processes sharing the
port (``reconciler.loop.workers``), each with this class's ``public`` over its own copy of the
snapshot; this process keeps the operations listener.

Both listeners are guarded (``reconciler.loop.listener``): a connection cap, a cap per client
(behind ``trusted_proxies`` the proxy is not capped so), header and idle timeouts, malformed
requests logged once per client per minute.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from reconciler.console import answer, is_console
from reconciler.fleet.view import FleetView
from reconciler.loop.client_address import Network
from reconciler.loop.fastlistener import FastListener
from reconciler.loop.listener import Credential, Guards, Handler, Limits, Listener
from reconciler.loop.public import PublicSide, none_match
from reconciler.publish import LiveAnswers

__all__ = ["HttpOutlet", "none_match", "status_document"]


class HttpOutlet:
    def __init__(self, answers: LiveAnswers, registry: CollectorRegistry, view: Callable[[], FleetView | None],
                 health: Callable[[], tuple[bool, str]], region_of: Callable[[str], str | None] | None = None,
                 trusted_proxies: tuple[Network, ...] = ()):
        self.answers = answers
        self.side = PublicSide(answers, health, region_of, trusted_proxies)
        self.registry = registry
        self.view = view
        self.health = health
        # aiohttp's low-level server with a dispatch of our own: a few fixed paths do not need the router
        # and middleware machinery, and skipping it serves ~25% more requests per core.
        self._pages = {"/healthz": self.healthz, "/metrics": self.metrics, "/status.json": self.status_json}
        self.credential: Credential | None = None
        self.listeners: list[Guards] = []

    @property
    def trusted_proxies(self) -> tuple[Network, ...]:
        return self.side.trusted_proxies

    @trusted_proxies.setter
    def trusted_proxies(self, value: tuple[Network, ...]) -> None:  # STEER-4: only their forwarding headers are believed
        self.side.trusted_proxies = value

    @property
    def region_of(self) -> Callable[[str], str | None] | None:
        return self.side.region_of

    @region_of.setter
    def region_of(self, value: Callable[[str], str | None] | None) -> None:
        self.side.region_of = value

    async def public(self, request: web.BaseRequest) -> web.StreamResponse:
        """The public side on aiohttp (a listener shared with the operations pages): what ``PublicSide`` says."""
        reply = self.side.answer(request.method, request.path, request.query, request.headers, request.remote or "",
                                 request.secure)
        return web.Response(status=reply.status, body=reply.body, headers=reply.headers)

    def fast_public(self, limits: Limits | None = None) -> FastListener:
        """The public listener on its own: the compiled parser, answers kept as bytes."""
        return FastListener("public", self.side, limits, trusted_proxies=lambda: self.trusted_proxies)

    async def operations(self, request: web.BaseRequest) -> web.StreamResponse:
        """The operations listener: health with reasons, metrics, status.json, the console; behind the credential if one is set."""
        if request.method not in ("GET", "HEAD"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
        page = self._pages.get(request.path)
        if page is None and not is_console(request.path):
            raise web.HTTPNotFound(text="not found\n")
        if self.credential is not None and not self.credential.accepts(request.headers.get("Authorization")):
            raise web.HTTPUnauthorized(text="unauthorized\n", headers={"WWW-Authenticate": self.credential.challenge})
        if page is None:
            return self.console(request)
        return await page(request)

    async def both(self, request: web.BaseRequest) -> web.StreamResponse:
        """One listener for both (``operations_listen`` equal to ``listen``): operations pages keep their credential."""
        if request.path.startswith("/sub/"):
            return await self.public(request)
        return await self.operations(request)

    async def start(self, host: str, port: int, operations: tuple[str, int] | None = None,
                    credential: Credential | None = None, limits: Limits | None = None, public: bool = True) -> None:
        """Listen on (host, port) for the public side and on ``operations`` for the rest; without
        ``operations``, or with the same address, one listener serves both. ``public=False``: the operations
        listener only (worker processes answer the public port: ``reconciler.loop.workers``)."""
        self.credential = credential

        def guarded(name: str, handle: Handler) -> Listener:
            return Listener(name, handle, limits, trusted_proxies=lambda: self.trusted_proxies)  # as reloads set them

        listeners: list[Guards]
        if not public:
            if operations is None or operations == (host, port):
                raise ValueError("the operations listener needs an address of its own when workers answer the public one")
            listeners = [guarded("operations", self.operations)]
            addresses = [operations]
        elif operations is None or operations == (host, port):
            listeners = [guarded("http", self.both)]
            addresses = [(host, port)]
        else:
            listeners = [self.fast_public(limits), guarded("operations", self.operations)]
            addresses = [(host, port), operations]
        self.listeners = listeners
        try:
            for listener, (h, p) in zip(listeners, addresses, strict=True):
                await listener.start(h, p)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for listener in self.listeners:
            await listener.stop()
        self.listeners = []

    # ------------------------------------------------------------------ operations

    async def healthz(self, request: web.BaseRequest) -> web.Response:
        ok, why = self.health()
        return web.Response(status=200 if ok else 503, text=why + "\n")

    async def metrics(self, request: web.BaseRequest) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status_json(self, request: web.BaseRequest) -> web.Response:
        return web.json_response(status_document(self.view()), dumps=lambda o: json.dumps(o, ensure_ascii=False))

    def console(self, request: web.BaseRequest) -> web.Response:
        """The read-only console (``reconciler.console``): its pages carry a user's subscription URL at most, which
        this listener's credential already guards."""
        page = answer(request.path, request.query, request.headers.get("Accept-Language"), self.view(), time.time(),
                      lambda user, rotate: self.answers.tokens.token(user, rotate))
        return web.Response(status=page.status, body=page.body, headers=page.headers)


def status_document(view: FleetView | None) -> dict[str, Any]:
    if view is None:
        return {"ready": False}
    v = view.verdicts
    servers = {}
    for s in view.cluster.servers:
        sv = v.server(s.name) if v is not None else None
        servers[s.name] = {"status": sv.status if sv else "no_data", "label": sv.label if sv else "no_data",
                           "in_rotation": sv.in_rotation if sv else True, "rotation": sv.rotation if sv else "yes",
                           "out_for": sv.out_for if sv else None, "unreachable_from": sv.unreachable_from if sv else None,
                           "marks": [m.as_json() for m in sv.marks] if sv else [],
                           "reason": sv.reason if sv else "no health data yet", "country": s.country,
                           "traffic_mbps": round(view.traffic_mbps.get(s.name, 0.0), 3),
                           "connected_users": view.connected.get(s.name, 0), "assigned_users": view.assigned.get(s.name, 0),
                           # as a witness: its votes discarded (HEALTH-6), or losing many servers as a censor would
                           "unreliable_witness": sv.unreliable_witness if sv else False,
                           "censored_witness": sv.censored_witness if sv else False}
    routes = {}
    for route in view.cluster.effective_routes:
        members = view.cluster.members.get(route.id, ())
        verdicts = {m.inbound.id: v.inbound(m.inbound.id) for m in members} if v is not None else {}
        active = [m.inbound.id for m in members if v is None or verdicts[m.inbound.id].in_rotation]
        regional = {i: iv.out_for for i, iv in verdicts.items() if iv.out_for}  # out for one region only (HEALTH-15)
        routes[route.id] = {"inbounds": [m.inbound.id for m in members], "active": active, "regional": regional,
                            "best_available_only": bool(members) and not active and not regional}
    return {"ready": True, "time": v.now if v is not None else time.time(), "servers": servers, "routes": routes}
