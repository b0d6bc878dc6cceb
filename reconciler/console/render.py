"""The console's pages: which path is which page, in which language, with which headers (pure: the caller passes the
fleet view, the time and the token lookup, and serves the answer).

Paths: ``/`` the fleet, ``/server/<name>`` a server's card, ``/user/<name>`` a user's card, ``/users?q=`` a search of
the users, ``/routes`` the routes and the topology. Server-rendered by Jinja2 with autoescaping, in English or
Russian (``?lang=``, else ``Accept-Language``), with the subscription page's stylesheet and a few rules of its own,
inline and allowed by its hash: the policy allows no script at all, so every page works as it is.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import quote

import jinja2

from reconciler.console import views
from reconciler.fleet.view import FleetView
from reconciler.subscriptions.page import choose_language, qr_svg, read_catalog

_PACKAGE = "reconciler.console"
LANGUAGES = ("en", "ru")


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    headers: dict[str, str]


@functools.cache
def catalog(lang: str) -> dict[str, str]:
    """The console's words in ``lang`` (``i18n/<lang>.json``)."""
    return read_catalog(_PACKAGE, LANGUAGES, lang)


def language(accept_language: str | None, query: str | None) -> str:
    """The page's language: the subscription page's choice when the console has it, else English."""
    lang = choose_language(accept_language, query)
    return lang if lang in LANGUAGES else "en"


@functools.cache
def _css() -> str:
    page = resources.files("reconciler.subscriptions").joinpath("templates/page.css").read_text("utf-8")
    return page + resources.files(_PACKAGE).joinpath("templates/console.css").read_text("utf-8")


def headers(lang: str) -> dict[str, str]:
    """No caching (a user card holds a subscription URL), no sniffing, no referrer, no framing; nothing runs or loads
    but the page's own stylesheet (by its hash); forms (the user search) go to this listener only."""
    digest = base64.b64encode(hashlib.sha256(_css().encode()).digest()).decode()
    policy = (f"default-src 'none'; style-src 'sha256-{digest}'; img-src data:; base-uri 'none'; form-action 'self'; "
              "frame-ancestors 'none'")
    return {"content-type": "text/html; charset=utf-8", "content-language": lang, "cache-control": "no-store",
            "vary": "Accept-Language", "content-security-policy": policy, "x-content-type-options": "nosniff",
            "referrer-policy": "no-referrer", "x-frame-options": "DENY"}


def label_text(t: Mapping[str, str], label: str) -> str:
    """A verdict label (``Verdicts.labels``) in the page's language."""
    if label.startswith("unreachable from "):
        return t["status_unreachable_from"].format(country=label.removeprefix("unreachable from "))
    return t.get(f"status_{label.replace('-', '_')}", label)


def rotation_text(t: Mapping[str, str], rotation: str) -> str:
    if rotation.startswith("not for "):
        return t["rotation_not_for"].format(region=rotation.removeprefix("not for "))
    return t.get(f"rotation_{rotation}", rotation)


@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader(_PACKAGE, "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["q"] = lambda value: quote(str(value), safe="")
    return env


def is_console(path: str) -> bool:
    return path in ("/", "/routes", "/users") or path.startswith(("/server/", "/user/"))


def answer(path: str, query: Mapping[str, str], accept_language: str | None, view: FleetView | None, now: float,
           token_of: Callable[[str, int], str]) -> Answer:
    """The page at ``path`` (``is_console``): 200, 404 for a server or user the file does not hold, 503 before the
    loop's first interval."""
    lang = language(accept_language, query.get("lang"))
    t = catalog(lang)
    base: dict[str, Any] = {"t": t, "lang": lang, "css": _css(), "path": path, "label_text": functools.partial(label_text, t),
                            "rotation_text": functools.partial(rotation_text, t),
                            "languages": [(code, catalog(code)["language_name"]) for code in LANGUAGES]}
    if view is None:
        return _page("starting.html", base, lang, 503)
    context: dict[str, Any] | views.Unknown
    if path == "/":
        template, context = "fleet.html", views.fleet(view, now)
    elif path == "/routes":
        template, context = "routes.html", views.routes(view)
    elif path == "/users":
        template, context = "users.html", views.users(view.cluster, query.get("q", ""), view)
    elif path.startswith("/server/"):
        template, context = "server.html", views.server(view, path.removeprefix("/server/"), now)
    else:
        template, context = "user.html", views.user(view, path.removeprefix("/user/"), token_of)
        if not isinstance(context, views.Unknown) and context["url"]:
            context["qr"] = qr_svg(context["url"])
    if isinstance(context, views.Unknown):
        return _page("unknown.html", {**base, "message": t[f"unknown_{context.kind}"].format(name=context.name)}, lang, 404)
    return _page(template, {**base, **context}, lang, 200)


def _page(template: str, context: dict[str, Any], lang: str, status: int) -> Answer:
    body = _environment().get_template(template).render(context).encode()
    return Answer(status, body, headers(lang))
