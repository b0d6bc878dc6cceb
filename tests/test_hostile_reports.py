"""Agent reports are hostile input: every malformed one is refused with a reason, never an exception
other than ``ReportError``, and never a value that breaks an interval (the loop's fold and the
learned state's save run on whatever parses)."""

from __future__ import annotations

import json
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.errors import ReportError
from reconciler.fleet import Learned, parse_report
from tests.test_loop import agent_json, cluster

CLUSTER = cluster(3, users=2)
GOOD = json.loads(agent_json(probes={"s1-in": {"ok": True, "rtt_ms": 3.0}}))


def mutated(**changes: object) -> str:
    raw = dict(GOOD)
    for key, value in changes.items():
        if value is ...:
            raw.pop(key, None)
        else:
            raw[key] = value
    return json.dumps(raw)


HOSTILE = {
    "traffic not an object": mutated(traffic="lots"),
    "traffic up is text": mutated(traffic={"up": "1", "down": 2}),
    "traffic negative": mutated(traffic={"up": -5, "down": 2}),
    "traffic a bool": mutated(traffic={"up": True, "down": 2}),
    "traffic a float": mutated(traffic={"up": 1.5, "down": 2}),
    "traffic huge": mutated(traffic={"up": 10**40, "down": 0}),
    "probes a list": mutated(probes=[1, 2]),
    "probe not an object": mutated(probes={"s1-in": 7}),
    "probe ok missing": mutated(probes={"s1-in": {"rtt_ms": 1}}),
    "probe ok text": mutated(probes={"s1-in": {"ok": "yes"}}),
    "probe rtt NaN": '{"service": "active", "probes": {"s1-in": {"ok": true, "rtt_ms": NaN}}}',
    "probe rtt Infinity": '{"service": "active", "probes": {"s1-in": {"ok": true, "rtt_ms": Infinity}}}',
    "probe error object": mutated(probes={"s1-in": {"ok": False, "error": {"a": 1}}}),
    "listeners a list": mutated(listeners=["443/tcp"]),
    "listener not a bool": mutated(listeners={"443/tcp": "yes"}),
    "users an object": mutated(users={"a": 1}),
    "user not text": mutated(users=[1, 2]),
    "connections negative": mutated(connections=-1),
    "connections text": mutated(connections="many"),
    "took_ms NaN": '{"service": "active", "took_ms": NaN}',
    "service an object": mutated(service={"a": 1}),
    "service missing": mutated(service=...),
    "a JSON array": "[]",
    "a JSON string": '"active"',
    "deep nesting": '{"service": "active", "probes": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "too large": "x" * (33 * 1024 * 1024),
}


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_report_is_refused_with_a_reason(text):
    # spec: HEALTH-3 — an unreadable report is no report: no_data, never down, never a crash
    with pytest.raises(ReportError) as exc:
        parse_report("s0", text, 1.0)
    assert str(exc.value)


def test_long_texts_are_cut_and_a_null_traffic_is_the_api_being_down():
    r = parse_report("s0", mutated(service="active" + "x" * 10_000, traffic=None,
                                   probes={"s1-in": {"ok": False, "error": "e" * 10_000}}), 1.0)
    assert r.traffic_bytes is None and len(r.service) <= 64 and len(r.probes["s1-in"].error or "") <= 256


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                           max_leaves=20)
report_like = st.fixed_dictionaries({"service": json_values}, optional={
    "traffic": json_values, "probes": st.dictionaries(st.sampled_from(["s1-in", "s2-in", "x"]), json_values, max_size=3),
    "listeners": json_values, "users": json_values, "connections": json_values, "took_ms": json_values})


# RECONCILER_FUZZ_EXAMPLES=100000 for a long run (make test runs the default in a few seconds).
@settings(max_examples=int(os.environ.get("RECONCILER_FUZZ_EXAMPLES", "400")), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(report_like)
def test_any_report_parses_or_is_refused_and_what_parses_folds_and_saves(raw):
    try:
        rep = parse_report("s0", json.dumps(raw), 1e9)
    except ReportError:
        return
    learned = Learned.fresh(CLUSTER)
    learned.fold(CLUSTER, {"s0": rep, "s1": None, "s2": None}, 1e9)
    Learned.from_bytes(learned.to_bytes())
    assert rep.traffic_bytes is None or rep.traffic_bytes >= 0
    assert all(p.rtt_ms is None or math.isfinite(p.rtt_ms) for p in rep.probes.values())


def test_mutated_real_reports_parse_or_are_refused_never_anything_else():
    from tests.fuzz_reports import run

    result = run(3000, seed=7)
    assert result["tracebacks"] == 0 and result["refused"] > 500 and result["parsed"] > 100, result
    assert result["slowest_s"] < 5, result  # a bound that only a hang would break
