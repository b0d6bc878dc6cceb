"""Marks and regional verdicts everywhere an operator looks: `status`, `status SERVER`, the status page and JSON,
the topology in its three formats, the metrics and the webhook's events (HEALTH-8, HEALTH-13, HEALTH-14, HEALTH-15).

The verdicts come from the real engine folding real agent reports (``tests.test_loop.report``) for a fleet with
three servers in a censoring country; the views are the product's own renderers and commands."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from reconciler.config import load_cluster
from reconciler.console import answer
from reconciler.fleet.events import verdict_events
from reconciler.fleet.learned import Learned
from reconciler.fleet.view import FleetView
from reconciler.loop.http import status_document
from reconciler.metrics import LoopStats
from reconciler.model import Cluster
from reconciler.state.folder import StateFolder
from reconciler.topology import dot, mermaid, svg
from tests.test_loop import collector_text, report, run_intervals

COUNTRIES = {"ru-1": "RU", "ru-2": "RU", "ru-3": "RU", "de-1": "DE", "nl-1": "NL", "us-1": "US", "fr-1": "FR"}


def cluster_text() -> str:
    lines = ["settings:", "  health: {report_interval: 10s}", "  outputs: {state_dir: state, subscriptions_dir: subs}",
             "servers:"]
    for i, (name, country) in enumerate(COUNTRIES.items()):
        lines += [f"  - name: {name}", f"    host: 198.18.0.{20 + i}", f"    country: {country}", "    inbounds:",
                  f"      - {{id: {name}-in, name: \"{name}\", protocol: vless-tls, port: 443, route: r,"
                  " tls: {server_name: www.lab.test}}"]
    lines += ["routes:", "  - {id: r, name: R}", "users:", "  - {name: ivan, region: EEU}", "  - {name: anna, region: WEU}"]
    return "\n".join(lines) + "\n"


@pytest.fixture
def fleet(tmp_path: Path) -> tuple[Path, Cluster, Learned, float]:
    """An hour of ordinary loss, then RU's witnesses lose de-1, nl-1 and fr-1 while de-1 alone loses us-1."""
    path = tmp_path / "cluster.yaml"
    path.write_text(cluster_text())
    loaded = load_cluster(str(path))
    assert loaded.cluster is not None, loaded.errors
    c = loaded.cluster
    learned = Learned.fresh(c)
    start = time.time() - 330 * 10 + 5  # the last report a few seconds ago: `status` reads it as fresh
    run_intervals(c, learned, 300, start, rng=np.random.default_rng(1), loss=0.03)
    blocked = {w: {"de-1-in", "nl-1-in", "fr-1-in"} for w in ("ru-1", "ru-2", "ru-3")} | {"de-1": {"us-1-in"}}
    now = start + 300 * 10
    run_intervals(c, learned, 30, now, blocked=blocked)
    StateFolder(tmp_path / "state").save_learned(learned)
    return path, c, learned, now + 29 * 10


def test_regional_verdicts_and_marks_show_in_status_and_status_server(fleet, cli, monkeypatch):
    # spec: HEALTH-13, HEALTH-15, HEALTH-8: `status` says from where and for whom, and shows a mark, not "ok"
    monkeypatch.setenv("RECONCILER_SECRET", "views-test-secret-0123456789abcdef")
    path = fleet[0]
    run = cli("status", "-f", str(path), "--json")
    assert run.rc == 0, run.err
    rows = {r["server"]: r for r in json.loads(run.out)["servers"]}
    assert rows["de-1"]["status"] == "unreachable from RU" and rows["de-1"]["in_rotation"] == "not for EEU"
    assert "unreachable from 3 of your 3 servers in RU" in rows["de-1"]["why"]
    assert rows["us-1"]["status"] == "pair-unreachable" and rows["us-1"]["in_rotation"] == "yes"
    assert rows["us-1"]["marks"] == 1 and "de-1 cannot reach us-1 (one direction)" in rows["us-1"]["why"]
    assert rows["ru-1"]["status"] == "ok" and rows["ru-1"]["in_rotation"] == "yes"
    table = cli("status", "-f", str(path))
    assert "unreachable from RU" in table.out and "not for EEU" in table.out and "pair-unreachable" in table.out

    one = cli("status", "de-1", "-f", str(path), "-o", "json")
    data = json.loads(one.out)
    assert data["label"] == "unreachable from RU" and data["unreachable_from"] == "RU" and data["out_for"] == "EEU"
    assert data["inbounds"][0]["in_rotation"] == "not for EEU"
    witness = json.loads(cli("status", "ru-2", "-f", str(path), "-o", "json").out)
    assert witness["censored_witness"] and "ru-2 cannot reach de-1, nl-1, fr-1; they reach each other" in witness["sees"]
    assert "likely censored in RU" in witness["reason"]
    marked = cli("status", "us-1", "-f", str(path))
    assert "pair-unreachable" in marked.out and "de-1 cannot reach us-1" in marked.out

    # A user of EEU is kept off de-1; a user of WEU may have it (HEALTH-15).
    ivan = json.loads(cli("status", "ivan", "-f", str(path), "-o", "json").out)
    assert ivan["entries"][0]["server"] not in ("de-1", "nl-1", "fr-1")


def test_regional_verdicts_and_marks_show_in_the_page_the_topology_and_the_metrics(fleet):
    # spec: HEALTH-13, HEALTH-14, HEALTH-15, ROUTE-8
    _, c, learned, now = fleet
    v = learned.current_verdicts(c, now)
    view = FleetView(cluster=c, verdicts=v)
    doc = status_document(view)
    assert doc["servers"]["de-1"]["label"] == "unreachable from RU" and doc["servers"]["de-1"]["rotation"] == "not for EEU"
    assert doc["servers"]["us-1"]["marks"][0]["witness"] == "de-1" and doc["servers"]["us-1"]["marks"][0]["witness_country"] == "DE"
    assert doc["routes"]["r"]["regional"] == {"de-1-in": "EEU", "nl-1-in": "EEU", "fr-1-in": "EEU"}
    page = answer("/", {}, None, view, now, lambda user, rotate: "t").body.decode()  # the console's fleet
    assert "unreachable from RU" in page and "<b>not for EEU</b>" in page and "de-1 cannot reach us-1 (one direction)" in page
    routes = answer("/routes", {}, None, view, now, lambda user, rotate: "t").body.decode()
    assert ">de-1-in</a> — In rotation: not for EEU" in routes and 'data-status="pair-unreachable"' in routes

    labels = v.labels()
    assert labels["de-1"] == labels["de-1-in"] == "unreachable from RU" and labels["us-1"] == "pair-unreachable"
    for text in (mermaid(c, labels), dot(c, labels), svg(c, labels)):
        assert "unreachable from RU" in text and "pair-unreachable" in text, text[:400]

    metrics = collector_text(view, LoopStats())
    assert 'reconciler_server_unreachable_from{country="RU",region="EEU",server="de-1"} 1.0' in metrics
    assert 'reconciler_pair_mark{server="us-1",witness="de-1",witness_country="DE"} 1.0' in metrics
    assert 'reconciler_witness_censored{country="RU",server="ru-1"} 1.0' in metrics
    assert 'reconciler_witness_censored{country="DE",server="de-1"} 0.0' in metrics
    assert 'reconciler_server_unreachable_from{country="RU",region="EEU",server="us-1"}' not in metrics


def test_the_webhook_hears_of_every_server_customers_miss_on_a_start_then_of_changes_only(fleet):
    # spec: HEALTH-8, HEALTH-9, HEALTH-15: a start or a takeover (nothing said yet) reports all; then changes
    _, c, learned, now = fleet
    v = learned.current_verdicts(c, now)
    last: dict[str, str] = {}
    first = {e.subject: e for e in verdict_events(v, last)}
    assert set(first) == {"de-1", "nl-1", "fr-1", "us-1"}
    assert first["de-1"].kind == "unreachable_from" and first["de-1"].data["country"] == "RU"
    assert first["de-1"].text.startswith("customers in RU most likely cannot reach de-1")
    assert first["us-1"].kind == "pair_unreachable" and first["us-1"].data["countries"] == ["DE"]
    assert verdict_events(v, last) == []  # nothing changed: nothing said again
    healed = learned.fold(c, {s.name: report(s.name, c, now + 10) for s in c.servers}, now + 10)
    assert verdict_events(healed, last) == []  # clearing is not news for the webhook
    payload = first["de-1"].payload(now)
    assert payload["event"] == "unreachable_from" and payload["server"] == "de-1" and payload["region"] == "EEU"
