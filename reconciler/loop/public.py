"""What the public listener answers, whatever speaks HTTP for it: the one place that decides it.

- ``GET|HEAD /sub/<token>[/<format>]`` (or ``?format=``): the user's subscription from the current snapshot (the
  same ``render`` as the files, cached per snapshot), with the headers clients read and an ETag
  (``If-None-Match`` → 304). An unknown token gets 404 and nothing else, but before the first snapshot every token
  gets 503 with ``Retry-After`` (an app may take a 404 for a deleted subscription). A disabled or expired user gets
  403 with a one-line reason (the renderer's refusal), never a profile. A browser (no format asked for, HTML
  preferred, a browser's User-Agent: ``subscriptions.page.wants_page``) gets the subscription page instead, in the
  language of ``?lang=`` or ``Accept-Language``, its URLs under ``public_url`` or else the request's own scheme and
  Host (a trusted proxy's ``X-Forwarded-Proto``/``-Host`` believed).
- ``/healthz``: whether the loop ticks on time (the operations listener says why; this one only whether).
- Anything else: 404; a method other than GET and HEAD: 405.

No answer names the server. ``PublicSide.answer`` takes the request's parts (method, decoded path, query and
headers as mappings whose ``get`` ignores the name's case, the peer's address) and gives a ``Reply``; the aiohttp
listener (``reconciler.loop.http``) and the compiled-parser one (``reconciler.loop.fastlistener``) both ask it.
A ``Reply`` also says what else its answer depends on (``varies``), so a listener may keep its encoded bytes and
answer the next such request without asking again: pre-rendered bytes with the least Python per request.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from reconciler.loop.client_address import Network, client_address
from reconciler.publish import LiveAnswers
from reconciler.subscriptions import FORMATS, choose_format
from reconciler.subscriptions.page import choose_language, page_headers, render_page, wants_page
from reconciler.subscriptions.urls import request_base

#: Seconds an app is asked to wait (``Retry-After``) while the endpoint starts, before its first snapshot: the first
#: interval, which a start runs at once, takes a few seconds even for a million users.
STARTING_RETRY_AFTER = 10
FORMAT_ALIASES = {"links.txt": "links", "sing-box.json": "sing-box", "clash.yaml": "clash", "singbox": "sing-box",
                  "mihomo": "clash", "base64": "links"}
TEXT = {"Content-Type": "text/plain; charset=utf-8"}
#: What a subscription answer without an explicit format depends on besides its URL (``Vary`` says so to caches).
BY_AGENT = ("accept", "user-agent")


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    #: For a GET without ``If-None-Match``: the request headers (lower case) this answer depends on besides its URL,
    #: while the snapshot and settings stay; None: it may depend on more (the peer, the time, the health).
    varies: tuple[str, ...] | None = None


def text(status: int, line: str, headers: Mapping[str, str] | None = None,
         varies: tuple[str, ...] | None = None) -> Reply:
    return Reply(status, line.encode(), {**TEXT, **(headers or {})}, varies)


NOT_FOUND = text(404, "not found\n")
NOT_ALLOWED = text(405, "method not allowed\n", {"Allow": "GET, HEAD"})


class PublicSide:
    """The public listener's answers over one ``LiveAnswers``. ``region_of`` and ``trusted_proxies`` follow the
    cluster file (set on reloads); ``epoch`` changes whenever anything an answer kept by a listener depends on
    may have changed (a snapshot, those settings)."""

    def __init__(self, answers: LiveAnswers, health: Callable[[], tuple[bool, str]],
                 region_of: Callable[[str], str | None] | None = None, trusted_proxies: tuple[Network, ...] = ()):
        self.answers = answers
        self.health = health
        self._region_of = region_of
        self._trusted_proxies = trusted_proxies  # STEER-4: only their forwarding headers are believed
        self._settings = 0

    @property
    def region_of(self) -> Callable[[str], str | None] | None:
        return self._region_of

    @region_of.setter
    def region_of(self, value: Callable[[str], str | None] | None) -> None:
        self._region_of = value
        self._settings += 1

    @property
    def trusted_proxies(self) -> tuple[Network, ...]:
        return self._trusted_proxies

    @trusted_proxies.setter
    def trusted_proxies(self, value: tuple[Network, ...]) -> None:
        self._trusted_proxies = value
        self._settings += 1

    @property
    def epoch(self) -> tuple[int, int]:
        return self.answers.published, self._settings

    def answer(self, method: str, path: str, query: Mapping[str, str], headers: Mapping[str, str], remote: str,
               secure: bool) -> Reply:
        if method not in ("GET", "HEAD"):
            return NOT_ALLOWED
        if path.startswith("/sub/"):
            token, _, fmt = path[5:].partition("/")
            if not token or "/" in fmt:
                return NOT_FOUND
            return self.sub(token, fmt or None, query, headers, remote, secure)
        if path == "/healthz":
            ok, _ = self.health()
            return text(200, "ok\n") if ok else text(503, "unhealthy\n")
        return NOT_FOUND

    def sub(self, token: str, fmt_in_path: str | None, query: Mapping[str, str], headers: Mapping[str, str],
            remote: str, secure: bool) -> Reply:
        if self.answers.snapshot is None:  # just started: no token is known yet, and an app may take a 404 for a
            return text(503, "starting; try again shortly\n",  # deleted subscription
                        {"Retry-After": str(STARTING_RETRY_AFTER)})
        user = self.answers.user_of(token)
        if user is None:
            return NOT_FOUND
        requested = fmt_in_path or query.get("format")
        requested = FORMAT_ALIASES.get(requested, requested) if requested else None
        agent = headers.get("User-Agent")
        if wants_page(headers.get("Accept"), agent, requested):
            return self.page(token, user, query, headers, remote, secure)
        try:
            fmt = choose_format(requested, agent)
        except ValueError:
            return text(404, f"unknown format; use one of {', '.join(FORMATS)}\n", varies=())
        region = None
        if self._region_of:
            region = self._region_of(client_address(remote, headers, self._trusted_proxies))
        doc = self.answers.answer(user, fmt, region)
        varies = None if self._region_of else () if requested else BY_AGENT
        # The same URL gives a browser the page: caches must tell them apart.
        vary = _VARY_AGENT if requested is None else {}
        # A disabled or expired user gets the renderer's status and its one line, never a 304.
        if not doc.refused and none_match(headers.get("If-None-Match"), doc.etag):
            return Reply(304, b"", {"etag": doc.etag, **vary})
        return Reply(doc.status, doc.body, {**doc.headers, **vary} if vary else doc.headers, varies)

    def page(self, token: str, user: str, query: Mapping[str, str], headers: Mapping[str, str], remote: str,
             secure: bool) -> Reply:
        """The subscription page a browser gets (HEAD: its headers); its URLs under ``public_url``, else under
        the scheme and Host the request came with (a trusted proxy's forwarding headers believed)."""
        snapshot = self.answers.snapshot
        assert snapshot is not None  # user_of found the token in it
        scheme, host = ("https" if secure else "http"), headers.get("Host")
        try:
            proxied = any(ipaddress.ip_address(remote) in net for net in self._trusted_proxies)
        except ValueError:
            proxied = False
        if proxied:
            scheme = headers.get("X-Forwarded-Proto", scheme).split(",")[0].strip().lower()
            host = headers.get("X-Forwarded-Host", host or "").split(",")[0].strip() or host
        base = request_base(snapshot.cluster.settings.outputs.public_url, scheme, host)
        if base is None:
            return text(400, "bad Host header\n")
        lang = choose_language(headers.get("Accept-Language"), query.get("lang"))
        gaps = self.answers.left_out(user)
        return Reply(200, render_page(snapshot, user, token, base, lang, gaps), page_headers(lang))


_VARY_AGENT = {"Vary": "Accept, User-Agent"}


def none_match(header: str | None, etag: str) -> bool:
    """``If-None-Match`` by RFC 9110 §13.1.2: ``*`` matches, else any listed tag by weak comparison
    (``W/"x"`` and ``"x"`` are the same tag)."""
    if not header:
        return False
    if header.strip() == "*":
        return True
    ours = etag.removeprefix("W/")
    return any(tag.strip().removeprefix("W/") == ours for tag in header.split(","))
