"""No format emits an unverified TLS entry silently (issue 14), over every user and every format of the example.

A self-signed certificate is pinned where the format can pin, the entry is left out where it cannot, and
only an inbound that says ``tls.insecure: true`` (which ``validate`` warns about, at its line) gives clients
a skip-verification flag.
"""

from __future__ import annotations

import base64
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from reconciler.balance import Snapshot
from reconciler.config.loader import load_cluster
from reconciler.credentials import Secret
from reconciler.model import Cluster
from reconciler.subscriptions import FORMATS, render
from reconciler.subscriptions.outbound import pin_record, self_signed
from tests.conftest import EXAMPLE, example_text, plant

SECRET = Secret(b"formats-test-master-secret-0123456789")
UNVERIFIED = re.compile(r"insecure|allowInsecure|skip-cert-verify", re.I)
PIN = pin_record(base64.b64encode(bytes(range(32))).decode(), "cd" * 32)


def example(text: str | None = None) -> Cluster:
    return Cluster.model_validate(YAML(typ="safe").load(text if text is not None else example_text()))


def every_document(cluster: Cluster, **facts) -> dict[tuple[str, str], str]:
    """(user, format) → the document's text (links decoded), for a snapshot with these learnt facts."""
    snap = Snapshot(cluster=cluster, now=1.8e9, **facts)
    out = {}
    for user in cluster.users:
        for fmt in FORMATS:
            doc = render(snap, user.name, fmt, SECRET)
            out[user.name, fmt] = base64.b64decode(doc.body).decode() if fmt == "links" and not doc.refused else doc.body.decode()
    return out


def self_signed_ids(cluster: Cluster) -> list[str]:
    return [r.inbound.id for r in cluster.inbounds if hasattr(r.inbound, "tls") and self_signed(r.inbound.tls)]


def reality_keys(cluster: Cluster) -> dict[str, str]:
    return {r.inbound.id: "k" * 43 for r in cluster.inbounds if r.inbound.protocol == "vless-reality"}


@pytest.mark.parametrize("learnt", ["nothing yet", "every pin"])
def test_no_output_of_the_example_skips_verification(learnt):
    cluster = example()
    pins = {i: PIN for i in self_signed_ids(cluster)} if learnt == "every pin" else {}
    docs = every_document(cluster, tls_pins=pins, public_keys=reality_keys(cluster))
    assert len(docs) == len(cluster.users) * len(FORMATS)
    found = {key: UNVERIFIED.findall(text) for key, text in docs.items() if UNVERIFIED.search(text)}
    assert not found, found
    if learnt == "every pin":  # and the pinned entries are there: sing-box pins keys, Mihomo certificates
        assert '"certificate_public_key_sha256"' in docs["alice", "sing-box"] and "fingerprint: " in docs["alice", "clash"]
        assert "pinSHA256=" + "cd" * 32 in docs["alice", "links"]


def test_only_an_inbound_that_says_insecure_gives_clients_a_skip_flag():
    text, _ = plant(example_text(), "tls: {server_name: fra-1.example.net}",
                    "tls: {server_name: fra-1.example.net, insecure: true}")
    cluster = example(text)
    docs = every_document(cluster, public_keys=reality_keys(cluster))
    flagged = {key for key, t in docs.items() if UNVERIFIED.search(t)}
    # fra-1-hy2 is in route "fast", which the file's users see (dave is disabled: a refusal, no entry)
    assert flagged and all(user != "dave" for user, _ in flagged)
    for key in flagged:
        lines = [line for line in docs[key].splitlines() if UNVERIFIED.search(line)]
        assert all("fra-1" in line or "203.0.113.11" in line for line in lines), lines


def test_validate_warns_at_the_line_of_insecure_true(tmp_path):
    text, line = plant(example_text(), "tls: {server_name: fra-1.example.net}",
                       "tls: {server_name: fra-1.example.net, insecure: true}")
    path = tmp_path / "cluster.yaml"
    path.write_text(text, encoding="utf-8")
    warnings = [d for d in load_cluster(str(path)).warnings if d.code == "insecure"]
    assert len(warnings) == 1 and "fra-1-hy2" in warnings[0].message and "skip certificate verification" in warnings[0].message
    assert warnings[0].line == line
    assert not [d for d in load_cluster(str(EXAMPLE)).warnings if d.code == "insecure"]


def test_the_live_endpoint_serves_a_refusal_with_its_status_and_the_file_outlet_writes_no_profile(tmp_path):
    # issue 14: a disabled or expired user got HTTP 200 and a profile routing `direct`.
    import asyncio

    import aiohttp
    from prometheus_client import CollectorRegistry

    from reconciler.credentials import user_credentials
    from reconciler.lab.demo import free_port
    from reconciler.loop.http import HttpOutlet
    from reconciler.publish import FileOutlet, LiveAnswers, Tokens

    cluster = example()
    snap = Snapshot(cluster=cluster, now=1.8e9, public_keys=reality_keys(cluster))  # 2027-01-15: bob not yet expired
    answers = LiveAnswers(SECRET, Tokens(SECRET))
    answers.publish(snap)
    outlet = HttpOutlet(answers, CollectorRegistry(auto_describe=False), lambda: None, lambda: (True, "ok"))
    port = free_port()

    async def go() -> None:
        await outlet.start("127.0.0.1", port)
        try:
            async with aiohttp.ClientSession() as s:
                for fmt in FORMATS:
                    async with s.get(f"http://127.0.0.1:{port}/sub/{user_credentials(SECRET, 'dave').token}/{fmt}",
                                     headers={"If-None-Match": "*"}) as r:
                        assert r.status == 403 and await r.text() == "This subscription is disabled. Ask the operator to enable it.\n"
                        assert r.headers["content-type"].startswith("text/plain") and "profile-title" in r.headers
                    async with s.get(f"http://127.0.0.1:{port}/sub/{user_credentials(SECRET, 'alice').token}/{fmt}") as r:
                        assert r.status == 200
        finally:
            await outlet.stop()

    asyncio.run(go())
    files = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    files.write(snap)
    folder = tmp_path / "subs" / user_credentials(SECRET, "dave").token
    assert (folder / "clash.yaml").read_text().startswith("This subscription is disabled")
    assert '"status": "403"' in (folder / "headers.json").read_text()


_LEAF = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text()


@settings(max_examples=400, deadline=None)
@given(st.recursive(_LEAF, lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=30))
def test_the_compact_json_encoder_writes_what_json_dumps_writes(value):
    # sing-box profiles are written with one C encoder made once (``formats._json``), not one a call: the same text.
    from reconciler.subscriptions.formats import _json

    assert _json(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))
