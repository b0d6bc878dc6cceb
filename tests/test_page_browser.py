"""The subscription page in a real browser (issue 16, item 4): the loop's HTTP outlet on loopback serves the
example cluster, headless Chromium opens /sub/<token> as a phone-sized window (390 px), and what it shows is
checked — the figures and the Russian words in the rendered DOM, no Content-Security-Policy violation in its
console, light and dark colours — and zbarimg decodes the screenshot's QR codes to exactly the per-format URLs.

Needs ``chromium`` and ``zbarimg`` (Debian: chromium, zbar-tools; `make setup` installs them); no root.
Screenshots are left in tests/artifacts/ for a look (git-ignored)."""

from __future__ import annotations

import asyncio
import shutil
import struct
import subprocess
import tempfile
import threading
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from reconciler.balance.snapshot import Snapshot
from reconciler.config import load_cluster
from reconciler.credentials import Secret, user_token
from reconciler.lab.demo import free_port
from reconciler.loop.http import HttpOutlet
from reconciler.model import UserUsage
from reconciler.publish import LiveAnswers, Tokens
from reconciler.subscriptions.page import catalog
from reconciler.subscriptions.urls import subscription_url
from tests.conftest import EXAMPLE, ROOT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ZBARIMG = shutil.which("zbarimg")
ARTIFACTS = ROOT / "tests" / "artifacts"
SECRET = Secret(b"page-browser-secret-0123456789abcdef")
NOW = datetime(2026, 5, 1, tzinfo=UTC).timestamp()
FORMATS = ("sing-box", "clash", "links")

pytestmark = pytest.mark.skipif(not (CHROMIUM and ZBARIMG), reason="needs chromium and zbarimg on PATH (Debian packages "
                                "chromium and zbar-tools; `make setup` installs them as root)")


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """The example cluster's live endpoint on loopback (its own event loop in a thread), its public_url this
    endpoint's address; yields its /sub/ root."""
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cluster.yaml"
        path.write_text(EXAMPLE.read_text().replace("public_url: http://127.0.0.1:8080", f"public_url: http://127.0.0.1:{port}"))
        cluster = load_cluster(str(path)).cluster
    assert cluster is not None and cluster.settings.outputs.public_url == f"http://127.0.0.1:{port}"
    usage = {"bob": UserUsage(up=30_000_000_000, down=90_500_000_000, next_reset=datetime(2026, 6, 1, tzinfo=UTC).timestamp())}
    answers = LiveAnswers(SECRET, Tokens(SECRET))
    answers.publish(Snapshot(cluster=cluster, now=NOW, usage=usage))
    http = HttpOutlet(answers, CollectorRegistry(), lambda: None, lambda: (True, "ok"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(http.start("127.0.0.1", port), loop).result(30)
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        yield f"http://127.0.0.1:{port}/sub/"
    finally:
        asyncio.run_coroutine_threadsafe(http.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def chromium(profile: Path, url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM
    run = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                          "--disable-extensions", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
                          *flags, url], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Content Security Policy" not in run.stderr and "CONSOLE" not in run.stderr, run.stderr[-2000:]
    return run


def screenshot(profile: Path, url: str, name: str, *flags: str, height: int = 1400) -> Path:
    path = ARTIFACTS / name
    path.unlink(missing_ok=True)
    chromium(profile, url, f"--window-size=390,{height}", f"--screenshot={path}", *flags)
    assert path.stat().st_size > 1000
    return path


def decoded(png: Path) -> set[str]:
    """What zbarimg reads in ``png``: one text per QR code found."""
    assert ZBARIMG
    run = subprocess.run([ZBARIMG, "--raw", "-q", str(png)], capture_output=True, text=True, timeout=60)
    assert run.returncode in (0, 4), run.stderr  # 4: no symbol found
    return {line for line in run.stdout.splitlines() if line}


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: object) -> None:
        self._skip += tag in ("style", "svg")

    def handle_endtag(self, tag: str) -> None:
        self._skip -= tag in ("style", "svg")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def dom_text(dom: str) -> str:
    parser = _Text()
    parser.feed(dom)
    return " ".join(" ".join(parser.parts).split())


def pixel(png: Path, x: int, y: int) -> tuple[int, int, int]:
    """One pixel of an 8-bit RGB or RGBA PNG (what Chromium writes), by the PNG spec's filters; stdlib only."""
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks, header = 8, [], b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        header = body if kind == b"IHDR" else header
        chunks += [body] if kind == b"IDAT" else []
        pos += 12 + length
    width, _, depth, colour = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and colour in (2, 6)
    bpp = 3 if colour == 2 else 4
    raw, stride, prev = zlib.decompress(b"".join(chunks)), width * bpp, bytearray(width * bpp)
    for row in range(y + 1):
        kind, line = raw[row * (stride + 1)], bytearray(raw[row * (stride + 1) + 1:(row + 1) * (stride + 1)])
        for i in range(stride):
            a, b = line[i - bpp] if i >= bpp else 0, prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            p = a + b - c
            paeth = a if abs(p - a) <= abs(p - b) and abs(p - a) <= abs(p - c) else b if abs(p - b) <= abs(p - c) else c
            line[i] = (line[i] + (0, a, b, (a + b) // 2, paeth)[kind]) & 0xFF
        prev = line
    return prev[x * bpp], prev[x * bpp + 1], prev[x * bpp + 2]


def test_the_page_in_a_real_browser_shows_the_figures_in_russian_and_its_qr_codes_decode_to_the_format_urls(served, tmp_path):
    token = user_token(SECRET, "bob")
    url = served + token
    dom = chromium(tmp_path / "profile", url, "--accept-lang=ru", "--dump-dom").stdout  # Accept-Language: ru
    text = dom_text(dom)
    ru = catalog("ru")
    assert '<html lang="ru" dir="ltr">' in dom
    assert "Example VPN" in text and ru["for_user"].format(name="bob") in text and ru["usage_heading"] in text
    assert f"{ru['used']} 120.5 GB {ru['limit']} 200.0 GB" in text and "2026-06-01" in text and "2027-06-30" in text
    assert ru["state_active"] in text and f"{served}{token}" in text
    formats = {subscription_url(served.removesuffix("/sub/"), token, fmt) for fmt in FORMATS}
    light = screenshot(tmp_path / "profile", url + "?lang=ru", "page-ru.png")
    assert decoded(light) == formats
    assert pixel(light, 2, 2) == (0xF6, 0xF7, 0xF9)  # the stylesheet applied under the page's CSP (light)
    dark = screenshot(tmp_path / "profile", url, "page-en-dark.png", "--force-dark-mode")
    assert decoded(dark) == formats  # still dark on white
    assert pixel(dark, 2, 2) == (0x0F, 0x12, 0x16)  # prefers-color-scheme: dark


def test_persian_right_to_left_and_a_refused_user_in_a_real_browser(served, tmp_path):
    token = user_token(SECRET, "bob")
    dom = chromium(tmp_path / "profile", served + token + "?lang=fa", "--dump-dom").stdout
    assert '<html lang="fa" dir="rtl">' in dom and catalog("fa")["usage_heading"] in dom_text(dom)
    rtl = screenshot(tmp_path / "profile", served + token + "?lang=fa", "page-fa.png")
    assert decoded(rtl) == {subscription_url(served.removesuffix("/sub/"), token, fmt) for fmt in FORMATS}
    dave = served + user_token(SECRET, "dave")  # disabled in the example
    text = dom_text(chromium(tmp_path / "profile", dave, "--dump-dom").stdout)
    assert catalog("en")["state_disabled"] in text and catalog("en")["reason_disabled"] in text and "/sub/" not in text
    assert decoded(screenshot(tmp_path / "profile", dave, "page-refused.png")) == set()
