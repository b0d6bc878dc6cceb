"""The read-only console on the operations listener: what its pages say, from verdicts the real health engine gave
for a fleet with three witnesses in a censoring country, and how the listener guards it (the same credential as
/metrics, 503 before the first interval, no script allowed). Its look in a real browser: ``test_console_browser``."""

from __future__ import annotations

import asyncio
import base64
import re
from html import unescape

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from reconciler.balance import Snapshot
from reconciler.console import answer
from reconciler.console.render import catalog
from reconciler.credentials import Secret
from reconciler.fleet.view import FleetView
from reconciler.lab.demo import free_port
from reconciler.loop.http import HttpOutlet
from reconciler.loop.listener import Credential
from reconciler.model import UserUsage
from reconciler.publish import LiveAnswers, Tokens
from tests.test_verdict_views import fleet  # noqa: F401 — the fixture: RU's witnesses lose de-1, nl-1 and fr-1

SECRET = Secret(b"console-secret-0123456789abcdef!")


def text_of(body: bytes) -> str:
    page = re.sub(r"<(style|svg)\b.*?</\1>", " ", body.decode(), flags=re.S)
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", page)).split())


def view_of(fleet_, usage: dict[str, UserUsage] | None = None) -> tuple[FleetView, float]:
    _, c, learned, now = fleet_
    v = learned.current_verdicts(c, now)
    snap = Snapshot(cluster=c, now=now, verdicts=v, usage=usage or {})
    return FleetView(cluster=c, verdicts=v, snapshot=snap, usage=snap.usage,
                     history={k: tuple(x) for k, x in learned.history.changes.items()}), now


def test_a_blocked_servers_card_names_the_witnesses_their_streaks_and_the_week_of_verdicts(fleet):  # noqa: F811
    # spec: HEALTH-13, HEALTH-15 — the verdict, its reason, each witness's streak against each inbound, the history
    view, now = view_of(fleet)
    page = answer("/server/de-1", {}, None, view, now, lambda user, rotate: "t")
    assert page.status == 200
    text = text_of(page.body)
    assert "Verdict: unreachable from RU" in text and "In rotation not for EEU" in text
    assert "unreachable from 3 of your 3 servers in RU: ru-1, ru-2, ru-3" in text
    for witness in ("ru-1", "ru-2", "ru-3"):  # each failed every probe of the 30 blocked intervals
        assert f"{witness} (RU): 30" in text
    assert "nl-1 (NL): 0" in text and "us-1 (US): 0" in text and "de-1 (DE)" not in text  # a server is not its own witness
    # The week: ok for the first 300 intervals, then unreachable for the last 30 (the latest first)
    rows = re.findall(r"(\d{4}-\d\d-\d\dT[\d:]+Z) (ok|unreachable) (\S+)", text)
    assert [status for _, status, _ in rows] == ["unreachable", "ok"], rows
    assert rows[1][2] == "50m" and "<rect" in page.body.decode()
    # In Russian: the console's words, the engine's reasons as they are
    ru = text_of(answer("/server/de-1", {"lang": "ru"}, None, view, now, lambda user, rotate: "t").body)
    assert f"{catalog('ru')['verdict']}: недоступен из RU" in ru and catalog("ru")["history_heading"] in ru


def test_the_fleet_the_routes_a_user_card_and_a_search(fleet):  # noqa: F811
    # spec: ROUTE-8, HEALTH-13
    view, now = view_of(fleet, {"ivan": UserUsage(up=1_000_000_000, down=2_500_000_000)})
    text = text_of(answer("/", {}, None, view, now, lambda user, rotate: "t").body)
    assert "7 servers, 1 routes, 2 users (2 served)" in text and "de-1 cannot reach us-1 (one direction)" in text
    user = answer("/user/ivan", {}, None, view, now, lambda user, rotate: "tok")
    text = text_of(user.body)
    assert "State: active" in text and "Used 3.5 GB" in text and "Region EEU" in text
    # ivan (EEU) is given no server RU's witnesses cannot reach; each entry has its dot and its reason
    entry = re.search(r'<tr data-inbound="([^"]+)">.*?data-label="([^"]+)"', user.body.decode(), re.S)
    assert entry is not None and entry.group(1) not in ("de-1-in", "nl-1-in", "fr-1-in") and entry.group(2)
    assert "public_url" in text  # the fixture's file sets none: the card says what to set
    found = text_of(answer("/users", {"q": "NN"}, None, view, now, lambda user, rotate: "t").body)
    assert "anna" in found and "ivan" not in found and "1 of 2 users" in found
    unknown = answer("/user/nobody", {}, None, view, now, lambda user, rotate: "t")
    assert unknown.status == 404 and "No user nobody in the cluster file." in text_of(unknown.body)
    starting = answer("/", {}, "ru", None, now, lambda user, rotate: "t")
    assert starting.status == 503 and catalog("ru")["starting"] in text_of(starting.body)


def test_the_console_is_behind_the_operations_credential_and_allows_no_script(fleet):  # noqa: F811
    view, _ = view_of(fleet)

    async def scenario() -> None:
        answers = LiveAnswers(SECRET, Tokens(SECRET))
        answers.publish(view.snapshot)
        http = HttpOutlet(answers, CollectorRegistry(), lambda: view, lambda: (True, "ok"))
        public, ops = free_port(), free_port()
        await http.start("127.0.0.1", public, ("127.0.0.1", ops), credential=Credential("basic", "ops:s3cret"))
        try:
            async with aiohttp.ClientSession() as s:
                for path in ("/", "/server/de-1", "/user/ivan", "/users?q=a", "/routes"):
                    async with s.get(f"http://127.0.0.1:{ops}{path}") as r:
                        assert r.status == 401 and "WWW-Authenticate" in r.headers
                    async with s.get(f"http://127.0.0.1:{public}{path}") as r:
                        assert r.status == 404  # never on the public listener
                auth = {"Authorization": "Basic " + base64.b64encode(b"ops:s3cret").decode()}
                async with s.get(f"http://127.0.0.1:{ops}/server/de-1", headers={**auth, "Accept-Language": "ru"}) as r:
                    assert r.status == 200 and r.headers["Content-Language"] == "ru"
                    policy = r.headers["Content-Security-Policy"]
                    assert "default-src 'none'" in policy and "script" not in policy and "Server" not in r.headers
                    assert "<script" not in await r.text()
                async with s.get(f"http://127.0.0.1:{ops}/server/%3Cb%3E", headers=auth) as r:
                    body = await r.text()
                    assert r.status == 404 and "No server &lt;b&gt;" in body and "server <b>" not in body  # never markup
        finally:
            await http.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("path", ["/server/", "/user/", "/server/a/b", "/user/" + "x" * 5000])
def test_odd_paths_get_an_answer_not_a_traceback(fleet, path):  # noqa: F811
    view, now = view_of(fleet)
    assert answer(path, {}, None, view, now, lambda user, rotate: "t").status == 404
