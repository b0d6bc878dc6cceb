"""The verdict engine, rule by rule, through scenario files: those the package ships (reconciler/health/examples, run by
`reconciler simulate --example NAME`) and the tests' own in tests/scenarios (HEALTH-1..13)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import reconciler.health
from reconciler.config import load_cluster, load_document
from reconciler.health import HealthEngine, HealthState, Topology
from reconciler.health.simulate import Scenario, World, inline_topology, run
from reconciler.model.cluster import HealthSettings


class _Scenarios:
    """The scenarios the package ships (``reconciler simulate --example NAME``), then the tests' own."""

    roots = (Path(reconciler.health.__file__).parent / "examples", Path(__file__).parent / "scenarios")

    def __truediv__(self, name: str) -> Path:
        return next((root / name for root in self.roots if (root / name).exists()), self.roots[-1] / name)

    def glob(self, pattern: str) -> list[Path]:
        return [p for root in self.roots for p in root.glob(pattern)]


SCENARIOS = _Scenarios()
F = HealthSettings().failure_streak


def load(name: str, **overrides) -> tuple[Scenario, Topology, HealthSettings]:
    scenario, diagnostics, _ = load_document(str(SCENARIOS / name), Scenario)
    assert scenario is not None, diagnostics
    if overrides:
        scenario = Scenario.model_validate({**scenario.model_dump(by_alias=True, exclude_none=True), **overrides})
    if scenario.cluster:
        cluster = load_cluster(str(((SCENARIOS / name).parent / scenario.cluster).resolve())).cluster
        return scenario, Topology.from_cluster(cluster), scenario.health or cluster.settings.health
    return scenario, inline_topology(scenario.servers), scenario.health or HealthSettings()


def timeline(name: str, **overrides) -> list[dict[str, object]]:
    """Per tick: server name → ServerVerdict."""
    scenario, topology, settings = load(name, **overrides)
    return [v.servers() for _, v in run(scenario, topology, settings)]


def first_tick(tl, server: str, status: str, start: int = 0) -> int | None:
    return next((t for t in range(start, len(tl)) if tl[t][server].status == status), None)


def test_country_block_is_caught_by_the_witnesses_in_that_country():
    # spec: HEALTH-7, HEALTH-5
    tl = timeline("block.yaml")
    hit = first_tick(tl, "de-1", "unreachable")
    assert hit is not None and 10 <= hit <= 10 + F  # detection within failure streak + 1 observations
    verdict = tl[hit]["de-1"]
    assert "of your 3 servers in RU: ru-1, ru-2, ru-3" in verdict.reason or "all in RU" in verdict.reason
    assert not verdict.in_rotation  # HEALTH-10
    # Nobody else was touched, and the verdict healed without a manual step (HEALTH-12).
    assert all(tl[t][s].status == "ok" for t in range(len(tl)) for s in tl[t] if s != "de-1")
    healed = first_tick(tl, "de-1", "ok", start=25)
    assert healed is not None and healed <= 25 + HealthSettings().recovery_streak


def test_outage_is_unreachable_with_witness_counts_then_heals():
    # spec: HEALTH-5, HEALTH-12, HEALTH-13
    tl = timeline("outage.yaml")
    hit = first_tick(tl, "ny-1", "unreachable")
    assert hit is not None and hit <= 5 + F
    reason = tl[hit]["ny-1"].reason
    assert reason.startswith("unreachable from 6 of your 6 servers:") and "fra-1" in reason
    assert tl[hit]["ny-1"].votes == 6 and tl[hit]["ny-1"].witnesses == 6
    assert first_tick(tl, "ny-1", "ok", start=15) <= 15 + HealthSettings().recovery_streak


def test_one_failed_probe_means_nothing():
    # spec: HEALTH-5: a single witness, a single failure, or a streak shorter than failure_streak convict nobody
    scenario, topology, settings = load("fleet.yaml", ticks=30, events=[
        {"at": 5, "until": 5 + F - 1, "block": {"from": "*", "to": "us-1"}},      # everyone, but too short a streak
        {"at": 5, "block": {"from": ["de-1"], "to": "us-2"}},                       # one witness, forever
    ])
    for _, v in run(scenario, topology, settings):
        assert v.server("us-1").status == "ok"
        assert v.server("us-2").status == "ok" and v.server("us-2").in_rotation


def test_self_reports_give_unavailable_and_no_data():
    # spec: HEALTH-2, HEALTH-3, HEALTH-10, HEALTH-13
    tl = timeline("self_reports.yaml")
    assert tl[5]["a"].status == "unavailable" and not tl[5]["a"].in_rotation
    assert "proxy service is not running" in tl[5]["a"].reason
    assert tl[5]["b"].status == "unavailable" and "nothing listening" in tl[5]["b"].reason
    assert tl[10]["a"].status == "ok" and tl[10]["b"].status == "ok"  # a healthy report clears it at once
    staleness = HealthSettings().staleness / HealthSettings().report_interval
    silent_from = 3
    for t in range(silent_from, 20):
        expected = "no_data" if t - (silent_from - 1) > staleness else "ok"
        assert tl[t]["c"].status == expected, t
        assert tl[t]["c"].in_rotation  # silence is not a verdict
    assert "no data — agent not answering" in tl[10]["c"].reason and "stale" in tl[10]["c"].reason
    assert tl[20]["c"].status == "ok"


def test_isolated_witness_is_ignored_and_outages_are_still_caught():
    # spec: HEALTH-6
    tl = timeline("isolated_witness.yaml")
    for t in range(3, 40):
        assert all(v.status == "ok" for v in tl[t].values()), t
    assert tl[10]["de-3"].unreliable_witness and "votes are ignored" in tl[10]["de-3"].reason
    hit = first_tick(tl, "us-1", "unreachable", start=40)
    assert hit is not None and hit <= 40 + F
    assert "de-3" not in tl[hit]["us-1"].reason


def test_half_the_fleet_down_is_detected_and_a_broken_witness_still_ignored():
    # spec: HEALTH-6: judged against the fleet's median, healthy witnesses stay reliable in a mass outage
    tl = timeline("half_down.yaml")
    down = ["s1", "s3", "s5", "s7", "s9"]
    for s in down:
        hit = first_tick(tl, s, "unreachable")
        assert hit is not None and hit <= 5 + F, s
    for t in range(len(tl)):
        for s in ("s4", "s6", "s8", "s10"):
            assert tl[t][s].status == "ok", (t, s)
    assert tl[15]["s2"].unreliable_witness


def test_split_pairs_are_marked_never_removed_and_name_both_servers():
    # spec: HEALTH-8
    tl = timeline("split_pair.yaml")
    end = tl[-1]
    us2 = end["us-2"]
    assert us2.status == "ok" and us2.in_rotation
    assert [m.text for m in us2.marks] == ["de-2 cannot reach us-2 (one direction)"]
    assert not end["de-2"].marks
    assert [m.text for m in end["fr-1"].marks] == ["nl-1 cannot reach fr-1 (both directions)"]
    assert [m.text for m in end["nl-1"].marks] == ["fr-1 cannot reach nl-1 (both directions)"]
    assert all(v.in_rotation for v in end.values())


def test_prober_blocks_with_advice_and_reaching_the_prober_means_nothing():
    # spec: HEALTH-9, HEALTH-10, HEALTH-12
    tl = timeline("prober.yaml")
    long = HealthSettings().prober_streak
    hit = first_tick(tl, "nl-1", "blocked")
    # The long streak, plus at most two checks while the prober's loss estimate is still uncertain.
    assert hit is not None and 40 + long - 1 <= hit <= 40 + long + 1
    streak = hit - 40 + 1
    assert tl[hit]["nl-1"].reason == f"blocked: prober msk-1 has not reached it for {streak} checks — change its IP"
    assert not tl[hit]["nl-1"].in_rotation
    assert all(tl[t]["msk-1"].status == "ok" and not tl[t]["msk-1"].marks for t in range(len(tl)))
    assert first_tick(tl, "nl-1", "ok", start=55) <= 55 + HealthSettings().recovery_streak


def test_a_lone_server_in_a_blocking_country_without_prober_only_marks():
    # spec: HEALTH-8, HEALTH-9: one witness never convicts; a prober's word is needed
    scenario, topology, settings = load("prober.yaml")
    servers = [s.model_copy(update={"prober": False}) for s in scenario.servers]
    scenario = scenario.model_copy(update={"servers": servers})
    verdicts = list(run(scenario, inline_topology(servers), settings))
    end = verdicts[54][1].server("nl-1")
    assert end.status == "ok" and end.in_rotation
    # The scenario also cuts nl-1 → msk-1, so the pair fails both ways.
    assert [m.text for m in end.marks] == ["msk-1 cannot reach nl-1 (both directions)"]


def test_a_broken_prober_blocks_no_one():
    # spec: HEALTH-9 with HEALTH-6: a prober whose every probe fails is unreliable, and its word counts for nothing
    scenario, topology, settings = load("prober.yaml", events=[{"at": 2, "isolate": "msk-1"}])
    for _, v in run(scenario, topology, settings):
        assert all(s.status == "ok" for s in v.servers().values())


def test_a_prober_blocked_from_every_server_leaves_rotation():
    # spec: HEALTH-9 (issue 15): the prober is not immune to the mesh: a quorum that cannot reach it convicts it
    scenario, topology, settings = load("prober.yaml", events=[{"at": 3, "block": {"from": "*", "to": "msk-1"}}])
    verdicts = list(run(scenario, topology, settings))
    end = verdicts[-1][1]
    assert end.server("msk-1").status == "unreachable" and not end.server("msk-1").in_rotation
    assert all(s.status == "ok" for name, s in end.servers().items() if name != "msk-1")


def test_flapping_target_is_damped_and_heals_after_it_settles():
    # spec: HEALTH-12: no flapping verdicts, nothing sticks
    tl = timeline("flapping.yaml")
    changes = sum(1 for t in range(1, len(tl)) if tl[t]["e"].status != tl[t - 1]["e"].status)
    undamped_cycles = (150 - 10) // 12
    assert changes < undamped_cycles * 2 * 0.6
    assert tl[-1]["e"].status == "ok"
    assert all(tl[t]["e"].status == "unreachable" for t in range(100, 150))  # held out while it keeps flapping


def test_no_false_verdicts_under_heavy_iid_loss_with_a_majority_quorum():
    # spec: HEALTH-5: the quorum scales with the witnesses that have fresh data
    servers = [{"name": f"s{i}", "country": ["DE", "DE", "DE", "NL", "US", "US", "FR", "RU", "RU", "RU"][i % 10]}
               for i in range(60)]
    scenario = Scenario.model_validate({"servers": servers, "ticks": 300, "seed": 11, "loss": 0.2})
    topology = inline_topology(scenario.servers)
    for _, v in run(scenario, topology, HealthSettings()):
        assert (v.status == 0).all()


def test_silence_never_removes_anything():
    # spec: HEALTH-10: no_data keeps servers in rotation, and missing witnesses shrink the quorum, not convict
    scenario, topology, settings = load("fleet.yaml", ticks=200, loss=0.05, events=[{"at": 0, "reports_missing": {"p": 0.7}}])
    for _, v in run(scenario, topology, settings):
        assert v.in_rotation.all()


def test_status_precedence_unavailable_over_unreachable():
    # spec: HEALTH-2, HEALTH-10: a fresh "not well" report explains the failed probes
    scenario, topology, settings = load("fleet.yaml", ticks=12,
                                        events=[{"at": 2, "down": "us-1"}, {"at": 2, "block": {"from": "*", "to": "us-1"}}])
    last = list(run(scenario, topology, settings))[-1][1]
    assert last.server("us-1").status == "unavailable"


def test_best_available_never_empty_and_prefers_rotation():
    # spec: HEALTH-11, LB-8
    names = [s["name"] for s in load_document(str(SCENARIOS / "fleet.yaml"), Scenario)[0].model_dump()["servers"]]
    scenario, topology, settings = load("fleet.yaml", ticks=10, events=[
        {"at": 0, "down": s} for s in names if s != "nl-1"] + [{"at": 0, "outage": "nl-1"}])
    last = list(run(scenario, topology, settings))[-1][1]
    ids = list(topology.inbounds)
    order = last.best_available(ids)
    assert sorted(order) == sorted(ids) and not last.in_rotation.any()
    assert order[0] == "nl-1-in"  # unreachable beats unavailable: it may still work for someone


def test_same_inputs_same_outputs_and_persisted_state_resumes_identically(tmp_path):
    # spec: HEALTH-12; the loop persists state (GITOPS-5)
    scenario, topology, settings = load("block.yaml")
    world = World(scenario, topology, settings.report_interval)
    observations = [world.observe(t) for t in range(scenario.ticks)]
    a = HealthEngine(topology, settings)
    first = [a.evaluate(o) for o in observations[:15]]
    saved = a.state.to_bytes()
    rest_a = [a.evaluate(o) for o in observations[15:]]
    b = HealthEngine(topology, settings, HealthState.from_bytes(saved, topology))
    rest_b = [b.evaluate(o) for o in observations[15:]]
    for x, y in zip(rest_a, rest_b, strict=True):
        assert (x.status == y.status).all() and (x.votes == y.votes).all()
    c = HealthEngine(topology, settings)
    again = [c.evaluate(o) for o in observations[:15]]
    assert all((x.status == y.status).all() for x, y in zip(first, again, strict=True))
    other = Topology(servers=("x",), countries=("DE",), probers=(False,), inbounds=("x-in",), inbound_server=(0,))
    assert HealthState.from_bytes(saved, other).fail.shape == (1, 1)  # another fleet starts afresh


def test_simulate_json_replays_identically(cli):
    # spec: HEALTH-12 (deterministic replay)
    path = str(SCENARIOS / "block.yaml")
    one = cli("simulate", path, "--json")
    two = cli("simulate", path, "--json")
    assert one.rc == 0 and one.out == two.out
    lines = [json.loads(x) for x in one.out.splitlines()]
    assert len(lines) == 40 and lines[0]["tick"] == 0
    de1 = lines[14]["servers"]["de-1"]
    assert set(de1) >= {"status", "in_rotation", "marks", "reason"} and de1["status"] == "unreachable"


def test_simulate_table_and_errors(cli, tmp_path):
    run_ = cli("simulate", str(SCENARIOS / "split_pair.yaml"))
    assert run_.rc == 0 and "de-2 cannot reach us-2 (one direction)" in run_.out
    bad = tmp_path / "s.yaml"
    bad.write_text("servers: [{name: a, country: DE}]\nticks: 5\nevents:\n  - {at: 1, outage: b}\n  - {at: 1, blok: x}\n")
    run_ = cli("simulate", str(bad))
    assert run_.rc == 1 and ":5:" in run_.err and "blok" in run_.err
    bad.write_text("servers: [{name: a, country: DE}]\nticks: 5\nevents:\n  - {at: 1, outage: b}\n")
    run_ = cli("simulate", str(bad))
    assert run_.rc == 1 and ":4:5: error: outage: unknown server 'b'" in run_.err


@pytest.mark.parametrize("n", [1, 2, 3])
def test_tiny_fleets_work(n):
    servers = [{"name": f"s{i}", "country": "DE"} for i in range(n)]
    scenario = Scenario.model_validate({"servers": servers, "ticks": 20, "events": [{"at": 5, "outage": "s0"}]})
    verdicts = [v for _, v in run(scenario, inline_topology(scenario.servers), HealthSettings())]
    assert len(verdicts) == 20
    if n >= 3:  # two witnesses can form a quorum (min_witnesses = 2)
        assert verdicts[-1].server("s0").status == "unreachable"
    else:
        assert verdicts[-1].server("s0").status == "no_data"


def test_state_stays_small_for_a_thousand_servers():
    topology = Topology(servers=tuple(f"s{i}" for i in range(1000)), countries=("DE",) * 1000, probers=(False,) * 1000,
                        inbounds=tuple(f"i{i}" for i in range(1000)), inbound_server=tuple(range(1000)))
    assert HealthState.initial(topology).nbytes() <= 16 * 2**20
    assert np.asarray(topology.own).sum() == 1000


# --------------------------------------------------------------------------- scenarios that state their own verdicts

EXPECTING = sorted(p.name for p in SCENARIOS.glob("*.yaml") if "\nexpect:" in p.read_text())
CENSORSHIP = {"two_servers.yaml": "HEALTH-8", "three_servers.yaml": "HEALTH-8", "four_servers.yaml": "HEALTH-6",
              "lone_censored_witness.yaml": "HEALTH-6", "wide_block.yaml": "HEALTH-7", "allow_list.yaml": "HEALTH-15",
              "prober_half.yaml": "HEALTH-9", "bursty_loss.yaml": "HEALTH-9"}


def test_the_fleets_operators_run_have_scenarios_with_expectations():
    # spec: HEALTH-6, HEALTH-7, HEALTH-8, HEALTH-9, HEALTH-15: every shape of fleet and censor has its file
    assert set(CENSORSHIP) <= set(EXPECTING)
    for name, rule in CENSORSHIP.items():
        assert rule in (SCENARIOS / name).read_text(), name


@pytest.mark.parametrize("name", EXPECTING)
def test_scenario_expectations_hold(name):
    # spec: HEALTH-5..HEALTH-15: each file asserts verdicts, marks and reasons at the ticks it names
    from reconciler.health.simulate import expectations

    scenario, topology, settings = load(name)
    assert scenario.expect
    assert expectations(scenario, topology, settings) == []


def test_a_missed_expectation_fails_simulate_and_says_where(cli, tmp_path):
    # spec: HEALTH-8: the expectation is checked, not decoration
    text = (SCENARIOS / "two_servers.yaml").read_text().replace('at: 66, server: b, marks: ["a cannot reach b (one direction)"]',
                                                               'at: 66, server: b, marks: ["a cannot reach b (both directions)"]')
    bad = tmp_path / "two.yaml"
    bad.write_text(text)
    out = cli("simulate", str(bad))
    line = next(i for i, x in enumerate(text.splitlines(), 1) if "(both directions)\"], reason" in x)
    assert out.rc == 1 and f"two.yaml:{line}:5: error: expectation not met: tick 66: b: marks" in out.err
    good = cli("simulate", str(SCENARIOS / "two_servers.yaml"))
    assert good.rc == 0 and "expectation(s) met" in good.err


def test_a_regional_verdict_is_in_rotation_elsewhere():
    # spec: HEALTH-15: out for users of the blocking country's region (and of unknown region), in for the others
    scenario, topology, settings = load("wide_block.yaml", ticks=10)
    engine = HealthEngine(topology, settings)
    world = World(scenario, topology, settings.report_interval)
    for t in range(10):
        v = engine.evaluate(world.observe(t))
    t = topology.inbounds.index("de-1-in")
    assert v.region_out(t) == "EEU" and not v.in_rotation[t]
    assert not v.in_rotation_for(t, "EEU") and not v.in_rotation_for(t, None) and v.in_rotation_for(t, "WEU")
    assert topology.country_codes[engine.state.unreach_scope[t]] == "RU"


def _cluster(servers: list[tuple[str, str]]):
    from reconciler.model import Cluster

    return Cluster.model_validate({"servers": [
        {"name": name, "host": f"198.18.0.{10 + i}", "country": country,
         "inbounds": [{"id": f"{name}-in", "name": name, "protocol": "vless-tls", "port": 443,
                       "tls": {"server_name": "www.lab.test"}}]} for i, (name, country) in enumerate(servers)]})


def test_learned_health_survives_a_fleet_change_and_an_older_state_file():
    # spec: HEALTH-15, GITOPS-5: a regional verdict's country is carried by its code when the fleet's countries
    # change; a state written before the loss weights and scopes existed restores with them fresh, losing nothing else
    from reconciler.fleet.learned import Learned

    before = _cluster([("ru-1", "RU"), ("ru-2", "RU"), ("de-1", "DE")])
    learned = Learned.fresh(before)
    topo = learned.topology
    t = topo.inbounds.index("de-1-in")
    learned.health.unreach_on[t] = True
    learned.health.unreach_scope[t] = topo.country_codes.index("RU")
    learned.health.cont_n[:] = 7.0
    after = learned.adopt(_cluster([("at-1", "AT"), ("ru-1", "RU"), ("ru-2", "RU"), ("de-1", "DE")]))
    codes = after.topology.country_codes
    assert codes.index("RU") != topo.country_codes.index("RU")  # the index moved
    t2 = after.topology.inbounds.index("de-1-in")
    assert codes[after.health.unreach_scope[t2]] == "RU" and after.health.unreach_on[t2]
    assert list(after.health.cont_n) == [0.0, 7.0, 7.0, 7.0]

    again, why = Learned.restore(learned.to_bytes(), before)
    assert why is None and again.health.unreach_scope[t] == learned.health.unreach_scope[t]
    assert (again.health.cont_n == 7.0).all()
    old = HealthState.from_arrays({k: v for k, v in vars(learned.health).items()
                                   if k not in ("hazard_n", "cont_n", "fleet_n", "unreach_scope")}, topo)
    assert (old.cont_n == 0).all() and (old.unreach_scope == -1).all() and old.unreach_on[t]
    wrong = HealthState.from_arrays({**vars(learned.health), "fail": np.zeros((9, 9), np.int16)}, topo)
    assert not wrong.unreach_on.any()  # another fleet's arrays: a fresh state, never a crash



@pytest.mark.parametrize("inbound_server", [(0, 0, 1, 2, 2, 2), (2, 0, 1, 1), (0, 1, 2), (1, 1, 1)])
def test_per_server_sums_each_servers_inbounds(inbound_server):
    # The witness-by-server view of HEALTH-6 (who loses whom), for one or several inbounds per server in any order.
    topo = Topology(servers=("a", "b", "c"), countries=("DE",) * 3, probers=(False,) * 3,
                    inbounds=tuple(f"i{k}" for k in range(len(inbound_server))), inbound_server=inbound_server)
    a = np.random.default_rng(len(inbound_server)).random((3, len(inbound_server))) < 0.5
    want = np.zeros((3, 3), dtype=np.int32)
    for t, s in enumerate(inbound_server):
        want[:, s] += a[:, t]
    assert (topo.per_server(a) == want).all() and (topo.any_per_server(a) == (want > 0)).all()
