"""The subscription page a browser gets at /sub/<token> (issue 16, item 4): who gets it (browsers, never apps),
in which language, what it shows, what it never shows (credentials; a refused user's URLs), and the headers
that keep its secret URL out of caches, referrers and other sites. The real browser: tests/test_page_browser.py."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import string
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote, unquote

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from reconciler.balance.snapshot import Snapshot
from reconciler.credentials import Secret, user_credentials, user_token
from reconciler.lab.demo import free_port
from reconciler.loop.http import HttpOutlet
from reconciler.model import Cluster, UserUsage
from reconciler.publish import LiveAnswers, Tokens
from reconciler.subscriptions.document import refusal_reason
from reconciler.subscriptions.page import LANGUAGES, catalog, choose_language, render_page, wants_page
from reconciler.subscriptions.urls import request_base, subscription_url

SECRET = Secret(b"page-test-secret-0123456789abcdef")
NOW = datetime(2026, 5, 1, tzinfo=UTC).timestamp()
DAY = 86400.0
BASE = "https://vpn.example.com"
CHROME = "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/126.0.0.0 Safari/537.36"
FIREFOX = "Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0"
SAFARI = "Mozilla/5.0 (iPhone; CPU iPhone OS 17_5 like Mac OS X) AppleWebKit/605.1.15 (KHTML, like Gecko) Version/17.5 Mobile/15E148 Safari/604.1"
HTML = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"


def cluster(title: str = "Lab VPN") -> Cluster:
    return Cluster.model_validate({"settings": {"outputs": {"profile_title": title}}, "servers": [], "users": [
        {"name": "alice"},
        {"name": "bob", "data_limit": "200GB", "expires": "2027-06-30", "reset": "monthly"},
        {"name": "dave", "enabled": False},
        {"name": "erin", "expires": "2026-03-31"},
        {"name": "frank", "data_limit": "10GB", "reset": "monthly"},
        {"name": "gina", "data_limit": "10GB"},
        {"name": "hal", "device_limit": 2, "on_device_limit": "refuse"},
    ]})


def snapshot(c: Cluster | None = None) -> Snapshot:
    reset = datetime(2026, 6, 1, tzinfo=UTC).timestamp()
    return Snapshot(cluster=c or cluster(), now=NOW, usage={
        "bob": UserUsage(up=30_000_000_000, down=90_500_000_000, next_reset=reset),
        "frank": UserUsage(up=1_000_000_000, down=9_500_000_000, next_reset=reset),
        "gina": UserUsage(down=12_000_000_000), "hal": UserUsage(devices=5)})


def page(user: str, lang: str = "en", snap: Snapshot | None = None) -> str:
    return render_page(snap or snapshot(), user, user_token(SECRET, user), BASE, lang).decode()


# ------------------------------------------------------------------ who gets the page


@pytest.mark.parametrize(("accept", "agent", "explicit", "page_"), [
    (HTML, CHROME, None, True),
    ("text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8", FIREFOX, None, True),
    ("text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8", SAFARI, None, True),
    (HTML, CHROME, "clash", False),  # an explicit format always wins
    (HTML, CHROME, "links", False),
    (HTML, "SFA/1.11.4 (Android)", None, False),
    (HTML, "SFI/1.10 (iOS)", None, False),
    (HTML, "sing-box 1.14.4", None, False),
    (HTML, "HiddifyNext/2.5.7", None, False),
    (HTML, "Mozilla/5.0 (Linux; Android 14) HiddifyNext/2.5.7", None, False),
    (HTML, "clash-verge/v1.7.7", None, False),
    (HTML, "FlClash/v0.8.80 clash-verge Platform/android", None, False),
    (HTML, "ClashMetaForAndroid/2.11.1.Meta", None, False),
    (HTML, "mihomo/1.19.0", None, False),
    (HTML, "Mozilla/5.0 Stash/2.4", None, False),
    (HTML, "v2rayNG/1.9.5", None, False),
    (HTML, "Mozilla/5.0 (Linux; Android 14) v2rayNG/1.9.5", None, False),
    (HTML, "Streisand/1.6", None, False),
    (HTML, "Shadowrocket/2.2.50 CFNetwork/1494", None, False),
    ("*/*", "curl/8.5.0", None, False),
    ("text/html", "curl/8.5.0", None, False),  # a tool, whatever it accepts
    ("text/html", "Wget/1.21", None, False),
    ("*/*", CHROME, None, False),  # a browser's fetch that does not ask for HTML
    ("application/json, text/html;q=0.5", CHROME, None, False),  # HTML named but not preferred
    ("text/html;q=0", CHROME, None, False),
    ("text/html;q=oops", CHROME, None, False),
    (None, CHROME, None, False),
    (HTML, None, None, False),
    (None, None, None, False),
])
def test_browsers_get_the_page_apps_and_explicit_formats_never(accept, agent, explicit, page_):
    assert wants_page(accept, agent, explicit) is page_


@pytest.mark.parametrize(("header", "query", "lang"), [
    (None, None, "en"),
    ("", None, "en"),
    ("ru-RU,ru;q=0.9,en-US;q=0.8,en;q=0.7", None, "ru"),
    ("de-DE,de;q=0.9,fa;q=0.5,en;q=0.3", None, "fa"),  # the first one there is a catalog for
    ("en;q=0.5, zh-CN", None, "zh"),  # by q, not by order
    ("zh-TW,zh;q=0.9", None, "zh"),
    ("fa-IR", None, "fa"),
    ("fr-FR,fr;q=0.9", None, "en"),
    ("ru;q=0, en;q=0.1", None, "en"),  # q=0: not acceptable
    ("ru;q=abc, fa;q=0.2", None, "fa"),  # a bad q counts as 0
    ("*", None, "en"),
    ("ru", "fa", "fa"),  # ?lang= overrides
    ("ru", "ZH-hans", "zh"),
    ("ru", "xx", "ru"),  # an unknown ?lang= is ignored
    ("ru", "", "ru"),
])
def test_language_from_the_query_then_accept_language_then_english(header, query, lang):
    assert choose_language(header, query) == lang


# ------------------------------------------------------------------ catalogs


def _fields(text: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(text) if name}


def test_every_catalog_has_every_key_with_the_same_placeholders_and_every_key_is_used():
    english = catalog("en")
    root = Path(__file__).resolve().parent.parent / "reconciler" / "subscriptions"
    for lang in LANGUAGES:
        strings = json.loads((root / "i18n" / f"{lang}.json").read_text("utf-8"))
        assert strings.keys() == english.keys(), lang
        for key, text in strings.items():
            assert isinstance(text, str) and text.strip(), (lang, key)
            assert _fields(text) == _fields(english[key]), (lang, key)
    used = (root / "templates" / "page.html").read_text("utf-8") + (root / "page.py").read_text("utf-8")
    for key in english:
        assert re.search(rf"\b{key}\b", used) or (key.startswith("state_") and "state_{standing}" in used), key


def test_persian_is_right_to_left_and_each_language_says_so():
    assert '<html lang="fa" dir="rtl">' in page("alice", "fa")
    assert '<html lang="en" dir="ltr">' in page("alice", "en")
    assert '<html lang="ru" dir="ltr">' in page("alice", "ru")
    assert '<html lang="zh-Hans" dir="ltr">' in page("alice", "zh")
    for lang in LANGUAGES:
        text = page("bob", lang)
        assert catalog(lang)["usage_heading"] in text and catalog(lang)["for_user"].format(name="bob") in text


# ------------------------------------------------------------------ what it shows


def test_a_served_user_sees_usage_limit_dates_qr_codes_import_links_and_the_url():
    text = page("bob")
    token = user_token(SECRET, "bob")
    assert "<title>Lab VPN</title>" in text and "Subscription of bob" in text and ">Active<" in text
    assert "120.5 GB" in text and "200.0 GB" in text and "2026-06-01" in text and "2027-06-30" in text
    assert '<progress class="" value="120500000000" max="200000000000">60%</progress>' in text
    assert text.count("<svg") == 3 and subscription_url(BASE, token) in text
    hrefs = dict(re.findall(r'<a href="([a-z0-9-]+)://([^"]+)" rel="noreferrer">', text))
    url = {fmt: subscription_url(BASE, token, fmt) for fmt in ("sing-box", "clash", "links")}
    name = quote("Lab VPN", safe="")
    assert hrefs["sing-box"] == f"import-remote-profile?url={quote(url['sing-box'], safe='')}#{name}"
    assert hrefs["hiddify"] == f"import/{url['sing-box']}#{name}"
    assert hrefs["v2rayng"] == f"install-config?url={quote(url['links'], safe='')}#{name}"
    assert hrefs["streisand"] == f"import/{url['links']}#{name}"
    assert hrefs["clash"] == f"install-config?url={quote(url['clash'], safe='')}&amp;name={name}"
    assert unquote(hrefs["clash"].split("url=")[1].split("&")[0]) == url["clash"]
    unlimited = page("alice")
    assert "Unlimited" in unlimited and "<progress" not in unlimited and "0 B" in unlimited


@pytest.mark.parametrize(("user", "state"), [
    ("dave", "Disabled"), ("erin", "Expired"), ("frank", "Over the traffic limit"), ("gina", "Over the traffic limit"),
    ("hal", "Over the device limit")])
def test_a_refused_user_sees_why_and_no_url_qr_code_or_import_link(user, state):
    snap = snapshot()
    text = page(user, snap=snap)
    assert f">{state}<" in text
    assert refusal_reason(snap, snap.cluster.user(user)) in text  # the same words the apps show, in English
    assert "<svg" not in text and "://" not in text and "/sub/" not in text and user_token(SECRET, user) not in text
    for lang in ("ru", "fa", "zh"):
        other = page(user, lang, snap)
        assert catalog(lang)[f"state_{snap.standing(snap.cluster.user(user))}"] in other and "<svg" not in other
    if user == "frank":
        assert "It resets on 2026-06-01." in text and "\u20682026-06-01\u2069" in page(user, "fa", snap)
    if user == "gina":
        assert "Ask the operator to raise the limit." in text


def test_the_profile_title_is_escaped_not_run():
    text = page("alice", snap=snapshot(cluster('<script>alert("x")</script> & "Co"')))
    assert "<script" not in text
    assert "<title>&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt; &amp; &#34;Co&#34;</title>" in text
    assert "#%3Cscript%3Ealert%28%22x%22%29%3C%2Fscript%3E%20%26%20%22Co%22" in text  # in the import links' names


def test_the_page_holds_no_credential_and_no_external_resource():
    for user in ("alice", "bob", "dave"):
        creds = user_credentials(SECRET, user, 0)
        for lang in LANGUAGES:
            text = page(user, lang)
            for value in (creds.uuid, creds.password, creds.ss_key_128, creds.ss_key_256, SECRET.derive("token", user).hex()):
                assert value not in text and quote(value, safe="") not in text
            assert "<script" not in text and "<link" not in text and " src=" not in text and "@import" not in text
            assert " style=" not in text  # inline style attributes would need 'unsafe-inline'


def test_request_base_is_public_url_or_the_requests_own():
    assert request_base("https://vpn.example.com/base/", "http", "evil.test") == "https://vpn.example.com/base"
    assert request_base(None, "http", "127.0.0.1:8080") == "http://127.0.0.1:8080"
    assert request_base(None, "https", "[2001:db8::1]:443") == "https://[2001:db8::1]:443"
    for scheme, host in (("http", None), ("http", ""), ("http", "a b"), ("http", 'x"><b>'), ("javascript", "x"),
                         ("http", "x/y"), ("http", "x@y")):
        assert request_base(None, scheme, host) is None


# ------------------------------------------------------------------ the live endpoint


def test_the_live_endpoint_gives_browsers_the_page_with_its_headers_and_apps_their_format():
    snap = snapshot()
    answers = LiveAnswers(SECRET, Tokens(SECRET))
    answers.publish(snap)
    http = HttpOutlet(answers, CollectorRegistry(), lambda: None, lambda: (True, "ok"))
    port = free_port()
    root = f"http://127.0.0.1:{port}/sub/"
    bob, dave = user_token(SECRET, "bob"), user_token(SECRET, "dave")
    browser = {"User-Agent": CHROME, "Accept": HTML, "Accept-Language": "ru-RU,ru;q=0.9,en;q=0.8"}

    async def go() -> None:
        await http.start("127.0.0.1", port)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(root + bob, headers=browser) as r:
                    text = await r.text()
                    assert r.status == 200 and r.headers["Content-Type"] == "text/html; charset=utf-8"
                    assert r.headers["Vary"] == "Accept, User-Agent, Accept-Language"
                    assert r.headers["Cache-Control"] == "no-store" and r.headers["X-Content-Type-Options"] == "nosniff"
                    assert r.headers["Referrer-Policy"] == "no-referrer" and r.headers["Content-Language"] == "ru"
                    policy = r.headers["Content-Security-Policy"]
                    style = text.split("<style>", 1)[1].split("</style>", 1)[0]
                    digest = base64.b64encode(hashlib.sha256(style.encode()).digest()).decode()
                    assert policy.startswith("default-src 'none';") and f"style-src 'sha256-{digest}'" in policy
                    assert "script-src" not in policy and "unsafe" not in policy
                    assert catalog("ru")["usage_heading"] in text  # by Accept-Language
                    # no public_url: the request's own base, in the plain URL and the import links
                    assert f">http://127.0.0.1:{port}/sub/{bob}</p>" in text and f"//127.0.0.1:{port}/sub/{bob}/links#" in text
                async with s.get(root + bob + "?lang=fa", headers=browser) as r:
                    assert 'dir="rtl"' in await r.text()
                async with s.head(root + bob, headers=browser) as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/html") and await r.read() == b""
                for agent, kind in (("SFA/1.11.4", "application/json"), ("clash-verge/v1.7", "text/yaml"),
                                    ("v2rayNG/1.9.5", "text/plain"), ("curl/8.5.0", "text/plain")):
                    async with s.get(root + bob, headers={**browser, "User-Agent": agent}) as r:
                        assert r.status == 200 and r.headers["Content-Type"].startswith(kind), agent
                        assert r.headers["Vary"] == "Accept, User-Agent" and "<html" not in await r.text()
                for path in (bob + "/clash", bob + "?format=clash", bob + "/mihomo"):
                    async with s.get(root + path, headers=browser) as r:
                        assert r.headers["Content-Type"].startswith("text/yaml") and "Vary" not in r.headers, path
                async with s.get(root + dave, headers=browser) as r:
                    text = await r.text()
                    assert r.status == 200 and "<svg" not in text and catalog("ru")["reason_disabled"] in text
                async with s.get(root + dave, headers={"User-Agent": "v2rayNG/1.9.5"}) as r:
                    assert r.status == 403 and "disabled" in await r.text()
                async with s.get(root + "A" * 32, headers=browser) as r:
                    assert r.status == 404 and "<html" not in await r.text()
                async with s.get(root + bob, headers={**browser, "Host": "bad host"}) as r:
                    assert r.status == 400
        finally:
            await http.stop()

    asyncio.run(go())


def test_the_page_believes_forwarding_headers_from_trusted_proxies_only_and_prefers_public_url():
    from reconciler.loop.client_address import networks

    answers = LiveAnswers(SECRET, Tokens(SECRET))
    answers.publish(snapshot())
    alice = user_token(SECRET, "alice")
    forwarded = {"User-Agent": CHROME, "Accept": HTML, "X-Forwarded-Proto": "https", "X-Forwarded-Host": "vpn.test"}

    async def plain_url(http: HttpOutlet) -> str:
        port = free_port()
        await http.start("127.0.0.1", port)
        try:
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/sub/{alice}", headers=forwarded) as r:
                return (await r.text()).split('id="plain-url">', 1)[1].split("<", 1)[0].replace(str(port), "PORT")
        finally:
            await http.stop()

    def outlet(trusted: tuple[str, ...]) -> HttpOutlet:
        return HttpOutlet(answers, CollectorRegistry(), lambda: None, lambda: (True, "ok"), trusted_proxies=networks(trusted))

    assert asyncio.run(plain_url(outlet(()))) == f"http://127.0.0.1:PORT/sub/{alice}"
    assert asyncio.run(plain_url(outlet(("127.0.0.0/8",)))) == f"https://vpn.test/sub/{alice}"
    answers.publish(snapshot(Cluster.model_validate({**cluster().model_dump(mode="json", exclude_defaults=True),
                                                     "settings": {"outputs": {"public_url": "https://sub.example.org/"}}})))
    assert asyncio.run(plain_url(outlet(("127.0.0.0/8",)))) == f"https://sub.example.org/sub/{alice}"


def test_the_page_explains_an_entry_a_format_cannot_carry():
    # An app reading share links shows 1 entry where sing-box and Clash show 2: the page says which and why
    # (a self-signed Trojan certificate that share links cannot pin), beside the links' QR code only.
    from reconciler.fleet import snapshot as fleet_snapshot
    from reconciler.fleet.learned import Learned
    from reconciler.fleet.reality import with_reality_keys

    c = Cluster.model_validate({"servers": [{"name": "a", "host": "198.18.0.10", "country": "DE", "inbounds": [
        {"id": "a-t", "name": "Berlin TLS", "protocol": "trojan", "port": 8443, "tls": {"server_name": "a.vpn.test"},
         "route": "tls"},
        {"id": "a-ss", "name": "Berlin SS", "protocol": "shadowsocks-2022", "port": 8388, "route": "plain"}]}],
        "routes": [{"id": "tls", "name": "TLS"}, {"id": "plain", "name": "Plain"}], "users": [{"name": "alice"}]})
    snap = fleet_snapshot(c, Learned.fresh(c), with_reality_keys({}, c, SECRET), NOW)
    answers = LiveAnswers(SECRET, Tokens(SECRET))
    answers.publish(snap)
    gaps = answers.left_out("alice")
    assert gaps == {"links": ["Berlin TLS"]}, gaps
    for lang, says in (("en", "Not here: Berlin TLS"), ("ru", "Здесь нет: Berlin TLS")):
        html = render_page(snap, "alice", user_token(SECRET, "alice"), BASE, lang, gaps).decode()
        figures = dict(re.findall(r'<figure data-format="([^"]+)">(.*?)</figure>', html, re.S))
        assert says in figures["links"] and "left-out" not in figures["sing-box"] + figures["clash"]
