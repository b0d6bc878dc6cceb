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


def collector_scrape(per_user: bool = True) -> str:
    """One scrape of the collector with a realistic view: five servers, one inbound failing for two witnesses,
    a capacity estimate, users with usage (issue 16); per-user series on unless asked (off by default in a file)."""
    from reconciler.fleet.learned import Learned
    from reconciler.fleet.view import FleetView
    from reconciler.model import Cluster, UserUsage
    from tests.test_loop import LoopStats, cluster, collector_text, snapshot_after  # the collector with a realistic view

    data = cluster(5).model_dump(mode="json", exclude_none=True)
    data["settings"]["users"] = {"metrics_per_user": per_user}
    c = Cluster.model_validate(data)
    learned = Learned.fresh(c)
    snap = snapshot_after(c, learned, blocked={"s1": {"s0-in"}, "s2": {"s0-in"}})
    usage = {u.name: UserUsage(up=1000 * i, down=5000 * i, devices=1, servers=("s0",) if i % 2 else ())
             for i, u in enumerate(c.users)}
    view = FleetView(cluster=c, verdicts=snap.verdicts, snapshot=snap, rtt_ms={("WEU", "s0-in"): 3.0}, usage=usage,
                     capacity_mbps={"s1": 100.0},
                     user_bytes_by_server={"s0": (10, 20)}, user_bytes_by_route={"r": (10, 20)})
    return collector_text(view, LoopStats())


def emitted_metric_names() -> set[str]:
    text = collector_scrape()
    # samples, and families without one yet (sparse ones, such as failure streaks, when nothing fails)
    return {m.group(1) for m in re.finditer(r"^(?:# HELP )?([a-z_]+)(?:\{| )", text, re.M)}


def test_rules_and_dashboard_only_use_metrics_the_collector_emits():
    names = emitted_metric_names()
    exprs = [r["expr"] for g in _yaml(DEPLOY / "prometheus/alerts.yml")["groups"] for r in g["rules"]]
    dash = json.loads((DEPLOY / "grafana/dashboard.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert {"Fleet overview", "Verdict timeline", "Routes and pools", "Traffic and capacity", "Reconcile health", "Users"} <= {
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
    # issue 16: the users' families, and the per-user table says it needs metrics_per_user
    assert {"reconciler_users", "reconciler_users_near_quota", "reconciler_users_expiring",
            "reconciler_users_over_device_limit", "reconciler_route_user_traffic_bytes_total",
            "reconciler_server_user_traffic_bytes_total", "reconciler_user_traffic_period_bytes"} <= used
    [top] = [p for p in panels if "reconciler_user_traffic_period_bytes" in p["targets"][0]["expr"]]
    assert "topk(20," in top["targets"][0]["expr"] and "metrics_per_user" in top["description"]


USER_ALERTS = ("ReconcilerUserNearQuota", "ReconcilerUsersOverQuota", "ReconcilerMassExpiry", "ReconcilerMassExpired")


def test_user_alerts_exist_with_runbook_text_and_unit_tests():
    rules = {r["alert"]: r for g in _yaml(DEPLOY / "prometheus/alerts.yml")["groups"] for r in g["rules"]}
    tests = _yaml(DEPLOY / "prometheus/alerts.test.yml")["tests"]
    tested: dict[str, list] = {}
    for t in tests:
        for case in t.get("alert_rule_test", []):
            tested.setdefault(case["alertname"], []).append(case["exp_alerts"])
    for name in (*USER_ALERTS, "ReconcilerUsageNotCounted"):
        rule = rules[name]
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), name
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 80, name
        assert "user=" not in rule["expr"] and "by (user)" not in rule["expr"], name  # counts, never per user
        cases = tested.get(name, [])
        assert any(cases) and any(not c for c in cases), f"{name}: needs a firing and a quiet case"
    assert rules["ReconcilerUserNearQuota"]["labels"]["severity"] == "info"
    assert rules["ReconcilerUsersOverQuota"]["labels"]["severity"] == "info"
    assert rules["ReconcilerUsageNotCounted"]["labels"]["severity"] == "warning"
    assert "delta(" in rules["ReconcilerMassExpired"]["expr"]


def _input_series(text: str) -> list[dict[str, str]]:
    """A scrape as promtool input series: every sample, constant over 10 minutes."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            labels = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(sample.labels.items()))
            value = "Inf" if sample.value == float("inf") else repr(float(sample.value))
            out.append({"series": f"{sample.name}{{{labels}}}", "values": f"{value}x10"})
    return out


@pytest.mark.parametrize("per_user", [False, True])
def test_every_dashboard_query_is_valid_promql_and_returns_data_from_the_collector(tmp_path, per_user):
    # What the lab test checks against a real Prometheus, in a second: each query of every panel parses
    # (`promtool check rules`) and returns a sample from one scrape of the collector (a promtool unit test of
    # `absent(query)` that must stay quiet), with per-user series on and off (the table says they are off).
    promtool = tool("promtool")
    dash = json.loads((DEPLOY / "grafana/dashboard.json").read_text())
    exprs = [t["expr"].replace("$__rate_interval", "5m") for p in dash["panels"] for t in p.get("targets", [])]
    rules = {"groups": [{"name": "dashboard", "rules": [{"alert": f"Query{i}", "expr": f"absent({e})"}
                                                        for i, e in enumerate(exprs)]}]}
    (tmp_path / "queries.yml").write_text(json.dumps(rules))
    check = subprocess.run([promtool, "check", "rules", str(tmp_path / "queries.yml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    test = {"rule_files": ["queries.yml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": _input_series(collector_scrape(per_user)),
                       "alert_rule_test": [{"eval_time": "10m", "alertname": f"Query{i}", "exp_alerts": []}
                                           for i in range(len(exprs))]}]}
    (tmp_path / "queries.test.yml").write_text(json.dumps(test))
    run = subprocess.run([promtool, "test", "rules", "queries.test.yml"], cwd=tmp_path, capture_output=True, text=True)
    failed = re.findall(r"alertname: Query(\d+)", run.stdout + run.stderr)
    assert run.returncode == 0, [exprs[int(i)] for i in failed] or run.stdout + run.stderr


# --------------------------------------------------------------------------- Alertmanager (issue 16)

DURATION = re.compile(r"^((\d+)(y|w|d|h|m|s|ms))+$")
MATCHER = re.compile(r'^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*$')
# The fields Alertmanager (0.26+) reads; an unknown one makes it refuse the whole file.
AM_TOP = {"global", "route", "inhibit_rules", "receivers", "templates", "time_intervals", "mute_time_intervals"}
AM_ROUTE = {"receiver", "group_by", "continue", "matchers", "group_wait", "group_interval", "repeat_interval", "routes",
            "mute_time_intervals", "active_time_intervals"}
AM_INHIBIT = {"source_matchers", "target_matchers", "equal"}
AM_NOTIFIERS = {
    "webhook_configs": {"send_resolved", "http_config", "url", "url_file", "max_alerts", "timeout"},
    "telegram_configs": {"send_resolved", "http_config", "api_url", "bot_token", "bot_token_file", "chat_id",
                         "message_thread_id", "message", "disable_notifications", "parse_mode"},
}


def _matchers(items: list[str]) -> list[tuple[str, str, str]]:
    out = []
    for m in items:
        got = MATCHER.match(m)
        assert got, f"not an Alertmanager matcher: {m!r}"
        if got.group(2) in ("=~", "!~"):
            re.compile(got.group(3))
        out.append((got.group(1), got.group(2), got.group(3)))
    return out


def _matches(matchers: list[tuple[str, str, str]], labels: dict[str, str]) -> bool:
    for name, op, value in matchers:
        have = labels.get(name, "")
        ok = {"=": have == value, "!=": have != value, "=~": re.fullmatch(value, have) is not None,
              "!~": re.fullmatch(value, have) is None}[op]
        if not ok:
            return False
    return True


def _route(route: dict, labels: dict[str, str], inherited: dict) -> dict:
    """The route an alert ends at (first matching child, depth first, no `continue` in this file)."""
    settings = {**inherited, **{k: v for k, v in route.items() if k != "routes"}}
    for child in route.get("routes", []):
        if _matches(_matchers(child.get("matchers", [])), labels):
            return _route(child, labels, settings)
    return settings


def test_alertmanager_config_is_well_formed_and_routes_every_alert():
    # amtool is not in `make setup` (Debian's prometheus-alertmanager 0.25 is too old for bot_token_file): the
    # file's structure is checked here against the fields Alertmanager reads; amtool checks it too when present.
    path = DEPLOY / "alertmanager/alertmanager.yml"
    text = path.read_text()
    am = _yaml(path)
    assert set(am) <= AM_TOP and {"route", "receivers"} <= set(am)
    names = [r["name"] for r in am["receivers"]]
    assert len(names) == len(set(names)) and {"users", "operators"} <= set(names)

    def walk(route: dict, top: bool) -> None:
        assert set(route) <= AM_ROUTE, set(route) - AM_ROUTE
        assert route.get("receiver", "x" if not top else None) and (route.get("receiver") is None or route["receiver"] in names)
        assert top or route.get("matchers"), "a child route without matchers catches everything"
        _matchers(route.get("matchers", []))
        for key in ("group_wait", "group_interval", "repeat_interval"):
            if key in route:
                assert DURATION.match(route[key]), (key, route[key])
        for child in route.get("routes", []):
            walk(child, False)

    walk(am["route"], True)
    for rule in am.get("inhibit_rules", []):
        assert set(rule) <= AM_INHIBIT
        _matchers(rule["source_matchers"])
        _matchers(rule["target_matchers"])
    for receiver in am["receivers"]:
        kinds = set(receiver) - {"name"}
        assert kinds and kinds <= set(AM_NOTIFIERS), kinds
        for kind in kinds:
            for cfg in receiver[kind]:
                assert set(cfg) <= AM_NOTIFIERS[kind], set(cfg) - AM_NOTIFIERS[kind]
                if kind == "webhook_configs":  # an example that can reach nothing outside this machine
                    assert re.match(r"^http://127\.0\.0\.1:\d+/", cfg["url"]), cfg["url"]
                if kind == "telegram_configs":  # the token lives in a file outside git, never in this one
                    assert "bot_token" not in cfg and cfg["bot_token_file"] == "/etc/alertmanager/telegram.token"
                    assert isinstance(cfg["chat_id"], int) and cfg["chat_id"] != 0
                    assert cfg.get("parse_mode", "") in ("", "Markdown", "MarkdownV2", "HTML")
    assert not re.search(r"\b\d{8,10}:[A-Za-z0-9_-]{35}\b", text)  # the shape of a real bot token
    # Every alert of alerts.yml lands where it should: user alerts at `users`, one group per alert name; the
    # fleet's warnings and critical alerts at `operators`, repeated at least hourly.
    rules = [r for g in _yaml(DEPLOY / "prometheus/alerts.yml")["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= set(USER_ALERTS)
    for r in rules:
        got = _route(am["route"], {"alertname": r["alert"], **r["labels"]}, {})
        if r["alert"] in USER_ALERTS:
            assert got["receiver"] == "users" and got["group_by"] == ["alertname"], r["alert"]
        else:
            assert got["receiver"] == "operators", r["alert"]
        if r["labels"]["severity"] in ("critical", "warning") and r["alert"] not in USER_ALERTS:
            assert got["repeat_interval"] in ("30m", "1h"), r["alert"]
    amtool = shutil.which("amtool")
    if amtool is not None:
        check = subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


def _yaml(path: Path) -> dict:
    from ruamel.yaml import YAML

    return YAML(typ="safe").load(path.read_text())
