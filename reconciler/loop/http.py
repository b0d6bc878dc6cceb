"""The loop's HTTP outlet (aiohttp, in the loop's own event loop).

- ``GET|HEAD /sub/<token>[/<format>]`` (or ``?format=``): the user's subscription
  from the current snapshot — the same ``render`` as the files, cached per
  snapshot — with the headers clients read and an ETag (``If-None-Match`` → 304).
  Unknown tokens get 404 and nothing else, but before the first snapshot every token gets
  503 with ``Retry-After`` (an app may take a 404 for a deleted subscription); no answer
  names the server (no ``Server`` header). A disabled or expired user gets 403 with
  a one-line reason (the renderer's refusal), never a profile. A browser (no format
  asked for, HTML preferred, a browser's User-Agent: ``subscriptions.page.wants_page``)
  gets the subscription page instead, in the language of ``?lang=`` or ``Accept-Language``,
  its URLs under ``public_url`` or else the request's own scheme and Host (a trusted
  proxy's ``X-Forwarded-Proto``/``-Host`` believed).
- ``/healthz``: 200 while the loop ticks on time, 503 otherwise (the operations
  listener says why; the public one only whether).

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

import ipaddress
import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from reconciler.console import answer, is_console
from reconciler.fleet.view import FleetView
from reconciler.loop.client_address import Network, client_address
from reconciler.loop.listener import Credential, Handler, Limits, Listener
from reconciler.publish import LiveAnswers
from reconciler.subscriptions import FORMATS, choose_format
from reconciler.subscriptions.page import choose_language, page_headers, render_page, wants_page
from reconciler.subscriptions.urls import request_base

#: Seconds an app is asked to wait (``Retry-After``) while the endpoint starts, before its first snapshot: the first
#: interval, which a start runs at once, takes a few seconds even for a million users.
STARTING_RETRY_AFTER = 10
_FORMAT_ALIASES = {"links.txt": "links", "sing-box.json": "sing-box", "clash.yaml": "clash", "singbox": "sing-box",
                   "mihomo": "clash", "base64": "links"}


class HttpOutlet:
    def __init__(self, answers: LiveAnswers, registry: CollectorRegistry, view: Callable[[], FleetView | None],
                 health: Callable[[], tuple[bool, str]], region_of: Callable[[str], str | None] | None = None,
                 trusted_proxies: tuple[Network, ...] = ()):
        self.answers = answers
        self.trusted_proxies = trusted_proxies  # STEER-4: only their forwarding headers are believed
        self.registry = registry
        self.view = view
        self.health = health
        self.region_of = region_of
        # aiohttp's low-level server with a dispatch of our own: a few fixed paths do not need the router
        # and middleware machinery, and skipping it serves ~25% more subscription requests per core.
        self._pages = {"/healthz": self.healthz, "/metrics": self.metrics, "/status.json": self.status_json}
        self.credential: Credential | None = None
        self.listeners: list[Listener] = []

    async def public(self, request: web.BaseRequest) -> web.StreamResponse:
        """The public listener: subscriptions and a bare health answer, nothing else."""
        if request.method not in ("GET", "HEAD"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
        path = request.path
        if path.startswith("/sub/"):
            token, _, fmt = path[5:].partition("/")
            if not token or "/" in fmt:
                raise web.HTTPNotFound(text="not found\n")
            return await self.sub(request, token, fmt or None)
        if path == "/healthz":
            ok, _ = self.health()
            return web.Response(status=200 if ok else 503, text="ok\n" if ok else "unhealthy\n")
        raise web.HTTPNotFound(text="not found\n")

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

        if not public:
            if operations is None or operations == (host, port):
                raise ValueError("the operations listener needs an address of its own when workers answer the public one")
            self.listeners = [guarded("operations", self.operations)]
            addresses = [operations]
        elif operations is None or operations == (host, port):
            self.listeners = [guarded("http", self.both)]
            addresses = [(host, port)]
        else:
            self.listeners = [guarded("public", self.public), guarded("operations", self.operations)]
            addresses = [(host, port), operations]
        try:
            for listener, (h, p) in zip(self.listeners, addresses, strict=True):
                await listener.start(h, p)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for listener in self.listeners:
            await listener.stop()
        self.listeners = []

    # ------------------------------------------------------------------ subscriptions

    async def sub(self, request: web.BaseRequest, token: str, fmt_in_path: str | None) -> web.StreamResponse:
        if self.answers.snapshot is None:  # just started: no token is known yet, and an app may take a 404 for a
            raise web.HTTPServiceUnavailable(text="starting; try again shortly\n",  # deleted subscription
                                             headers={"Retry-After": str(STARTING_RETRY_AFTER)})
        user = self.answers.user_of(token)
        if user is None:
            raise web.HTTPNotFound(text="not found\n")
        requested = fmt_in_path or request.query.get("format")
        requested = _FORMAT_ALIASES.get(requested, requested) if requested else None
        if wants_page(request.headers.get("Accept"), request.headers.get("User-Agent"), requested):
            return self.page(request, token, user)
        try:
            fmt = choose_format(requested, request.headers.get("User-Agent"))
        except ValueError:
            raise web.HTTPNotFound(text=f"unknown format; use one of {', '.join(FORMATS)}\n") from None
        region = None
        if self.region_of:
            region = self.region_of(client_address(request.remote or "", request.headers, self.trusted_proxies))
        doc = self.answers.answer(user, fmt, region)
        if doc.refused:  # a disabled or expired user: the renderer's status and its one line, never a 304
            response = web.Response(status=doc.status, body=doc.body, headers=doc.headers)
        elif none_match(request.headers.get("If-None-Match"), doc.etag):
            response = web.Response(status=304, headers={"etag": doc.etag})
        else:
            response = web.Response(body=doc.body, headers=doc.headers)
        if requested is None:  # the same URL gives a browser the page: caches must tell them apart
            response.headers["Vary"] = "Accept, User-Agent"
        return response

    def page(self, request: web.BaseRequest, token: str, user: str) -> web.Response:
        """The subscription page a browser gets (HEAD: its headers); its URLs under ``public_url``, else under
        the scheme and Host the request came with (a trusted proxy's forwarding headers believed)."""
        snapshot = self.answers.snapshot
        assert snapshot is not None  # user_of found the token in it
        scheme, host = ("https" if request.secure else "http"), request.headers.get("Host")
        try:
            proxied = any(ipaddress.ip_address(request.remote or "") in net for net in self.trusted_proxies)
        except ValueError:
            proxied = False
        if proxied:
            scheme = request.headers.get("X-Forwarded-Proto", scheme).split(",")[0].strip().lower()
            host = request.headers.get("X-Forwarded-Host", host or "").split(",")[0].strip() or host
        base = request_base(snapshot.cluster.settings.outputs.public_url, scheme, host)
        if base is None:
            raise web.HTTPBadRequest(text="bad Host header\n")
        lang = choose_language(request.headers.get("Accept-Language"), request.query.get("lang"))
        gaps = self.answers.left_out(user)
        return web.Response(body=render_page(snapshot, user, token, base, lang, gaps), headers=page_headers(lang))

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


def none_match(header: str | None, etag: str) -> bool:
    """``If-None-Match`` by RFC 9110 §13.1.2: ``*`` matches, else any listed tag by weak comparison
    (``W/"x"`` and ``"x"`` are the same tag)."""
    if not header:
        return False
    if header.strip() == "*":
        return True
    ours = etag.removeprefix("W/")
    return any(tag.strip().removeprefix("W/") == ours for tag in header.split(","))


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
