"""The page a browser gets at ``/sub/<token>``: what the user's subscription is and how to add it.

Apps keep getting their format: ``wants_page`` says yes only when no format was asked for (path or
``?format=``), the ``Accept`` header prefers HTML and the User-Agent is a browser's, not an app's. The page
shows the profile title, the user, their standing and, when not served, why; the traffic this period against
the limit, the next reset and the expiry; for a served user, one-tap import links for the common apps, a QR
code per format (inline SVG from segno) and the plain URL. It is rendered by Jinja2 with autoescaping from
``templates/`` in one of the ``i18n/`` catalogs (``choose_language``); Persian is right-to-left.

Pure: ``render_page`` reads the snapshot and the token-bearing base, never the master secret or a user's
credentials, so the page can hold no secret but its own address. ``page_headers`` forbid caching, sniffing,
referrers, framing and every external or inline resource but the one stylesheet (by its hash).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from urllib.parse import quote

import jinja2
import segno

from reconciler.balance.snapshot import Snapshot
from reconciler.subscriptions.document import choose_format
from reconciler.subscriptions.urls import subscription_url
from reconciler.text import size_text

_PACKAGE = "reconciler.subscriptions"
LANGUAGES = ("en", "ru", "fa", "zh")  # the catalogs in i18n/, English first (the fallback)
HTML_LANG = {"en": "en", "ru": "ru", "fa": "fa", "zh": "zh-Hans"}
RTL = frozenset({"fa"})
# Apps that read the links format (or fetch for another) and tools; sing-box and Clash apps are choose_format's.
_LINK_APPS = re.compile(r"v2ray|streisand|shadowrocket|quantumult|surge|loon|neko|karing|happ|v2box|foxray|"
                        r"okhttp|dart|curl|wget|python|go-http|aiohttp|java|libwww|httpie|powershell", re.I)
_BROWSER = re.compile(r"^Mozilla/\d")
_HTML_TYPES = ("text/html", "application/xhtml+xml")


def wants_page(accept: str | None, user_agent: str | None, explicit_format: str | None) -> bool:
    """Whether a request gets the page: no explicit format, ``Accept`` prefers HTML (q at least that of
    every other type it names) and the User-Agent is a browser's (``Mozilla/…``) naming no known app."""
    agent = user_agent or ""
    if explicit_format or not _BROWSER.match(agent) or choose_format(None, agent) != "links" or _LINK_APPS.search(agent):
        return False
    html = other = 0.0
    for media, q in _weighted(accept or ""):
        if media in _HTML_TYPES:
            html = max(html, q)
        elif "*" not in media:
            other = max(other, q)
    return html > 0 and html >= other


def choose_language(accept_language: str | None, query: str | None) -> str:
    """``?lang=`` when it names a catalog, else the ``Accept-Language`` range of the highest q that does
    (ties in the header's order), else English."""
    if query and (lang := _catalog_of(query)):
        return lang
    ranked = [(-q, i, lang) for i, (tag, q) in enumerate(_weighted(accept_language or "")) if q > 0 and (lang := _catalog_of(tag))]
    return min(ranked)[2] if ranked else "en"


def _catalog_of(tag: str) -> str | None:
    primary = tag.strip().lower().replace("_", "-").split("-")[0]
    return primary if primary in LANGUAGES else None


def _weighted(header: str) -> list[tuple[str, float]]:
    """``a;q=0.5, b`` → ``[("a", 0.5), ("b", 1.0)]`` (at most 64 items, names lower-cased; a bad q is 0)."""
    out = []
    for item in header.split(",")[:64]:
        name, *params = item.split(";")
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = min(1.0, max(0.0, float(value)))
                except ValueError:
                    q = 0.0
        if name.strip():
            out.append((name.strip().lower(), q))
    return out


@functools.cache
def catalog(lang: str) -> dict[str, str]:
    """The page's strings in ``lang`` (``i18n/<lang>.json``)."""
    return read_catalog(_PACKAGE, LANGUAGES, lang)


def read_catalog(package: str, languages: tuple[str, ...], lang: str) -> dict[str, str]:
    """A package's strings in ``lang``, one of its ``languages`` (``<package>/i18n/<lang>.json``)."""
    if lang not in languages:
        raise KeyError(lang)
    data: dict[str, str] = json.loads(resources.files(package).joinpath(f"i18n/{lang}.json").read_text("utf-8"))
    return data


@functools.cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader(_PACKAGE, "templates"), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


@functools.cache
def _css() -> str:
    return resources.files(_PACKAGE).joinpath("templates/page.css").read_text("utf-8")


def page_headers(lang: str) -> dict[str, str]:
    """The page's response headers: no caching (the URL is a secret), no sniffing, no referrer, no framing,
    and a policy that allows nothing but the page's own stylesheet (by its hash)."""
    digest = base64.b64encode(hashlib.sha256(_css().encode()).digest()).decode()
    policy = (f"default-src 'none'; style-src 'sha256-{digest}'; img-src data:; base-uri 'none'; form-action 'none'; "
              "frame-ancestors 'none'")
    return {"content-type": "text/html; charset=utf-8", "content-language": HTML_LANG[lang], "cache-control": "no-store",
            "vary": "Accept, User-Agent, Accept-Language", "content-security-policy": policy,
            "x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "x-frame-options": "DENY"}


@dataclass(frozen=True)
class Link:
    name: str
    href: str


def import_links(urls: dict[str, str], name: str) -> list[Link]:
    """One-tap imports, each in the format its app reads best (Hiddify: sing-box, as ``choose_format`` gives
    its User-Agent; v2rayNG and Streisand: links; Clash Meta clients: the Clash profile)."""
    enc = {fmt: quote(url, safe="") for fmt, url in urls.items()}
    tag = quote(name, safe="")
    return [Link("sing-box", f"sing-box://import-remote-profile?url={enc['sing-box']}#{tag}"),
            Link("Hiddify", f"hiddify://import/{urls['sing-box']}#{tag}"),
            Link("v2rayNG", f"v2rayng://install-config?url={enc['links']}#{tag}"),
            Link("Streisand", f"streisand://import/{urls['links']}#{tag}"),
            Link("Clash Verge, FlClash", f"clash://install-config?url={enc['clash']}&name={tag}")]


@functools.lru_cache(maxsize=1024)
def qr_svg(url: str) -> str:
    """The QR code of ``url`` as inline SVG (dark on white, sized by the page's stylesheet)."""
    return str(segno.make(url, error="m").svg_inline(scale=1, omitsize=True, dark="#000", light="#fff"))


def _day(epoch: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(epoch))


def reason_text(lang: str, standing: str, limit: int | None, date: str | None, devices: int,
                device_limit: int | None) -> str:
    """Why a user is not served, in ``lang`` (``document.refusal_reason`` says it in English); in a right-to-left
    language each figure is a bidi isolate, so ``200.0 GB`` is not shown as ``GB 200.0``."""
    t = catalog(lang)

    def fig(value: object) -> str:
        return f"\u2068{value}\u2069" if lang in RTL else str(value)

    if standing == "disabled":
        return t["reason_disabled"]
    if standing == "expired":
        return t["reason_expired"].format(date=fig(date or ""))
    if standing == "over_quota":
        back = t["reason_resets_on"].format(date=fig(date)) if date else t["reason_raise_limit"]
        return t["reason_over_quota"].format(limit=fig(size_text(limit or 0))) + " " + back
    if standing == "device_limit":
        return t["reason_device_limit"].format(devices=fig(devices), limit=fig(device_limit))
    return ""


def _left_out_note(t: dict[str, str], names: list[str], fmt: str) -> str:
    """Why an app reading ``fmt`` shows fewer entries than the others (its format cannot verify those servers)."""
    if not names:
        return ""
    others = t["qr_singbox"] if fmt != "sing-box" else t["qr_clash"]
    return t["left_out"].format(entries=", ".join(names), apps=others)


def render_page(snapshot: Snapshot, user_name: str, token: str, base_url: str, lang: str,
                left_out: Mapping[str, list[str]] | None = None) -> bytes:
    """The user's page in ``lang`` (a ``LANGUAGES`` code). ``token`` is the user's (already checked), ``base_url``
    what their URLs start with; a user who is not served gets the reason and no URL, QR code or import link.
    ``left_out``: format → the entries it cannot carry (``document.left_out``), explained beside its QR code."""
    t = catalog(lang)
    user = snapshot.cluster.user(user_name)
    standing = snapshot.standing(user)
    usage = snapshot.usage.get(user.name)
    used = usage.used if usage else 0
    next_reset = usage.next_reset if usage else None
    limit = user.data_limit
    title = snapshot.cluster.settings.outputs.profile_title
    when = user.expires_at if standing == "expired" else next_reset
    reason = reason_text(lang, standing, limit, _day(when) if when else None, usage.devices if usage else 0, user.device_limit)
    context = {
        "t": t, "title": title, "html_lang": HTML_LANG[lang], "dir": "rtl" if lang in RTL else "ltr", "css": _css(),
        "for_user": t["for_user"].format(name=user.name), "standing": standing, "state_text": t[f"state_{standing}"],
        "reason": reason, "used": used, "limit": limit, "used_text": size_text(used),
        "limit_text": size_text(limit) if limit else t["unlimited"],
        "percent": min(100, round(100 * used / limit)) if limit else 0,
        "reset_text": _day(next_reset) if next_reset else t["no_reset"],
        "expires_text": _day(user.expires_at) if user.expires_at else t["no_expiry"],
        "imports": [], "codes": [], "url": "", "languages": [(code, catalog(code)["language_name"]) for code in LANGUAGES],
    }
    if standing == "active":
        urls = {fmt: subscription_url(base_url, token, fmt) for fmt in ("sing-box", "clash", "links")}
        captions = {"sing-box": t["qr_singbox"], "clash": t["qr_clash"], "links": t["qr_links"]}
        context["imports"] = import_links(urls, title)
        context["codes"] = [{"format": fmt, "svg": qr_svg(url), "caption": captions[fmt],
                             "note": _left_out_note(t, (left_out or {}).get(fmt, []), fmt)} for fmt, url in urls.items()]
        context["url"] = subscription_url(base_url, token)
    return _environment().get_template("page.html").render(context).encode()
