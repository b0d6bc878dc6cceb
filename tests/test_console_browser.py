"""The console in a real browser: the loop's HTTP outlet on loopback serves the example cluster on its operations
listener behind basic credentials, with verdicts the real health engine folded from five hours of agent reports
(the last half hour with every witness losing ams-1). Headless Chromium (no script can run: the pages have none and
their policy allows none) opens the server card of a healthy and of a blocked server, the card of a user within
their quota and of one over it, in English and in Russian; the test checks the words and figures in the rendered
DOM, that nothing broke the page's policy, and that the user's QR code decodes to their subscription URL.

Needs ``chromium`` and ``zbarimg`` (`make setup` installs them); no root. Screenshots are left in tests/artifacts/."""

from __future__ import annotations

import asyncio
import re
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from reconciler.balance import Snapshot
from reconciler.config import load_cluster
from reconciler.console.render import catalog
from reconciler.credentials import Secret, user_token
from reconciler.fleet.learned import Learned
from reconciler.fleet.view import FleetView
from reconciler.lab.demo import free_port
from reconciler.loop.http import HttpOutlet
from reconciler.loop.listener import Credential
from reconciler.model import UserUsage
from reconciler.publish import LiveAnswers, Tokens
from reconciler.subscriptions.urls import subscription_url
from tests.conftest import EXAMPLE
from tests.test_loop import run_intervals
from tests.test_page_browser import ARTIFACTS, CHROMIUM, ZBARIMG, chromium, decoded, dom_text

SECRET = Secret(b"console-browser-secret-0123456789")
RESET = datetime(2027, 1, 15, tzinfo=UTC).timestamp()

pytestmark = pytest.mark.skipif(not (CHROMIUM and ZBARIMG), reason="needs chromium and zbarimg on PATH (Debian packages "
                                "chromium and zbar-tools; `make setup` installs them as root)")


@pytest.fixture(scope="module")
def console() -> Iterator[tuple[str, str]]:
    """(the operations listener's root with its credentials in the URL, the public root)."""
    public, ops = free_port(), free_port()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cluster.yaml"
        path.write_text(EXAMPLE.read_text().replace("public_url: http://127.0.0.1:8080", f"public_url: http://127.0.0.1:{public}"))
        cluster = load_cluster(str(path)).cluster
    assert cluster is not None
    learned = Learned.fresh(cluster)
    start = time.time() - 299 * 60  # the card's history runs to the request's own time
    run_intervals(cluster, learned, 270, start, rng=np.random.default_rng(3), loss=0.02, every_listener=True)  # 4.5 hours of ordinary loss
    lost = {"ams-1-reality", "ams-1-tuic"}
    blocked = {s.name: lost for s in cluster.servers if s.name != "ams-1"}
    now = start + 270 * 60
    run_intervals(cluster, learned, 30, now, blocked=blocked, every_listener=True)  # then every witness loses ams-1 for half an hour
    now += 29 * 60
    verdicts = learned.current_verdicts(cluster, now)
    usage = {"alice": UserUsage(up=2_000_000_000, down=10_400_000_000, next_reset=None, devices=2),
             "bob": UserUsage(up=60_000_000_000, down=151_000_000_000, next_reset=RESET, devices=1)}
    snap = Snapshot(cluster=cluster, now=now, verdicts=verdicts, usage=usage)
    view = FleetView(cluster=cluster, verdicts=verdicts, snapshot=snap, usage=usage,
                     history={k: tuple(x) for k, x in learned.history.changes.items()})
    ARTIFACTS.mkdir(exist_ok=True)
    answers = LiveAnswers(SECRET, Tokens(SECRET))
    answers.publish(snap)
    http = HttpOutlet(answers, CollectorRegistry(), lambda: view, lambda: (True, "ok"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(http.start("127.0.0.1", public, ("127.0.0.1", ops), credential=Credential(
        "basic", "ops:console-pass")), loop).result(30)
    try:
        yield f"http://ops:console-pass@127.0.0.1:{ops}", f"http://127.0.0.1:{public}"
    finally:
        asyncio.run_coroutine_threadsafe(http.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def shown(profile: Path, url: str, name: str) -> str:
    """The page's text as Chromium rendered it, and its screenshot (a wide window: the console is for desks)."""
    png = ARTIFACTS / name
    png.unlink(missing_ok=True)
    chromium(profile, url, "--window-size=1280,1600", f"--screenshot={png}")
    assert png.stat().st_size > 1000
    return dom_text(chromium(profile, url, "--dump-dom").stdout)


def test_server_cards_healthy_and_blocked_in_english_and_russian(console, tmp_path):
    # spec: HEALTH-13 — the verdict with its reason, the witnesses' streaks, the week's history, the load
    ops, _ = console
    healthy = shown(tmp_path / "p", f"{ops}/server/fra-1", "console-server-en.png")
    assert "Server fra-1" in healthy and "Verdict: ok" in healthy and "fra-1-reality" in healthy and "fra-1-hy2" in healthy
    assert "Learned capacity" in healthy and "Users assigned" in healthy and "Verdicts of the last 7 days" in healthy
    assert "ams-1 (NL): 0" in healthy and "msk-1 (RU): 0" in healthy  # every witness reaches fra-1, ams-1 too
    blocked = shown(tmp_path / "p", f"{ops}/server/ams-1", "console-server-blocked-en.png")
    assert "Verdict: unreachable" in blocked and "In rotation no" in blocked
    for witness in ("fra-1 (DE): 30", "ny-1 (US): 30", "dal-1 (US): 30"):
        assert witness in blocked
    # The week: the latest change first, with how long it has lasted (to the request's time); before it, hours of ok
    assert re.search(r"Z unreachable \d+m unreachable from 6 of your 6 servers.*Z ok 4h 3\dm ok", blocked), blocked
    ru = catalog("ru")
    blocked_ru = shown(tmp_path / "p", f"{ops}/server/ams-1?lang=ru", "console-server-blocked-ru.png")
    assert f"{ru['server_heading'].format(name='ams-1')}" in blocked_ru and f"{ru['verdict']}: недоступен" in blocked_ru
    assert ru["history_heading"] in blocked_ru and ru["col_witnesses"] in blocked_ru


def test_user_cards_within_and_over_quota_in_english_and_russian(console, tmp_path):
    ops, public = console
    alice = shown(tmp_path / "p", f"{ops}/user/alice", "console-user-en.png")
    assert "User alice" in alice and "State: active" in alice and "Used 12.4 GB" in alice and "Devices 2" in alice
    assert "europe" in alice and "fast" in alice and "ams-1" not in alice  # both routes; ams-1 is given to nobody
    url = subscription_url(public, user_token(SECRET, "alice"))
    assert url in alice
    assert decoded(ARTIFACTS / "console-user-en.png") == {url}
    ru = catalog("ru")
    bob = shown(tmp_path / "p", f"{ops}/user/bob?lang=ru", "console-user-over-quota-ru.png")
    assert f"{ru['state']}: {ru['state_over_quota']}" in bob and "211.0 GB" in bob and "200.0 GB" in bob
    assert ru["not_served"].format(state=ru["state_over_quota"]) in bob and "2027-01-15" in bob
    assert "/sub/" not in bob  # not served: no subscription URL, no QR code
    assert decoded(ARTIFACTS / "console-user-over-quota-ru.png") == set()
    fleet = shown(tmp_path / "p", f"{ops}/?lang=ru", "console-fleet-ru.png")
    assert ru["fleet_heading"] in fleet and "ams-1" in fleet and "недоступен" in fleet


def test_without_credentials_the_browser_gets_no_console(console, tmp_path):
    ops, _ = console
    bare = ops.replace("ops:console-pass@", "") + "/server/ams-1"
    text = dom_text(chromium(tmp_path / "p", bare, "--dump-dom").stdout)
    assert "ams-1" not in text and "Verdict" not in text  # Chromium waits at the credential prompt: nothing shown
    with pytest.raises(urllib.error.HTTPError) as refused:  # what it was answered (the listener is up: see above)
        urllib.request.urlopen(bare, timeout=10)
    refused.value.close()
    assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"].startswith("Basic")
