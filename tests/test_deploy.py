"""What operators deploy next to the loop: the Containerfile, alert rules, the Grafana dashboard (HEALTH-13)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip(f"{name} is not installed (`make setup` installs it)")
    return found


def test_containerfile_is_hadolint_clean_multi_stage_and_non_root():
    text = (ROOT / "Containerfile").read_text()
    lint = subprocess.run([tool("hadolint"), "--no-color", str(ROOT / "Containerfile")], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1] not in ("root", "0")
    assert 'ENTRYPOINT ["reconciler", "run"]' in text


def test_alert_rules_check_and_pass_their_unit_tests():
    promtool = tool("promtool")
    check = subprocess.run([promtool, "check", "rules", str(DEPLOY / "prometheus/alerts.yml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run([promtool, "test", "rules", "alerts.test.yml"], cwd=DEPLOY / "prometheus", capture_output=True, text=True)
    assert test.returncode == 0, test.stdout + test.stderr
    cfg = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus/prometheus.yml")], capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr


def test_blocked_alert_carries_the_change_ip_advice():
    text = (DEPLOY / "prometheus/alerts.yml").read_text()
    block = text[text.index("alert: VPNServerBlocked"):text.index("alert: VPNServerUnreachable")]
    assert "Change the server's IP address" in block


def emitted_metric_names() -> set[str]:
    from reconciler.fleet.learned import Learned
    from reconciler.metrics import FleetView
    from tests.test_loop import LoopStats, cluster, collector_text, snapshot_after  # the collector with a realistic view

    c = cluster(5)
    learned = Learned.fresh(c)
    snap = snapshot_after(c, learned)
    text = collector_text(FleetView(cluster=c, verdicts=snap.verdicts, snapshot=snap, rtt_ms={("WEU", "s0-in"): 3.0}), LoopStats())
    # samples, and families without one yet (sparse ones, such as failure streaks, when nothing fails)
    return {m.group(1) for m in re.finditer(r"^(?:# HELP )?([a-z_]+)(?:\{| )", text, re.M)}


def test_rules_and_dashboard_only_use_metrics_the_collector_emits():
    names = emitted_metric_names()
    exprs = [r["expr"] for g in _yaml(DEPLOY / "prometheus/alerts.yml")["groups"] for r in g["rules"]]
    dash = json.loads((DEPLOY / "grafana/dashboard.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert {"Fleet overview", "Verdict timeline", "Routes and pools", "Traffic and capacity", "Reconcile health"} <= {
        p["title"] for p in dash["panels"] if p["type"] == "row"}
    # issue 15: a datasource variable (provisioning-friendly), a description and a unit on every panel
    [variable] = dash["templating"]["list"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus" and "__inputs" not in dash
    for p in dash["panels"]:
        assert p.get("description"), p["title"]
    for p in panels:
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), p["title"]
        exprs += [t["expr"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\breconciler_[a-z_]+", e)}
    unknown = {u for u in used if u not in names}
    assert not unknown, unknown
    # traffic is a counter that panels rate(); no gauge holds a -1 sentinel
    assert "reconciler_server_traffic_bytes_total" in used and "reconciler_server_report_age_seconds" not in used
    for alert in ("ReconcilerDown", "ReconcilerAbsent", "ReconcilerIntervalsStalled"):
        assert alert in (DEPLOY / "prometheus/alerts.yml").read_text()


def _yaml(path: Path) -> dict:
    from ruamel.yaml import YAML

    return YAML(typ="safe").load(path.read_text())
