"""Health verdict simulation benchmark (issue: health engine).

Runs the real engine (reconciler.health) over many ticks and seeds and reports
false verdicts, detection and recovery times, flaps and cost. Anchors measured
in the same run: a naive "fixed quorum of 3" rule on the same probe data (the
research sketch's baseline), and a single numpy pass over the full mesh for the
tick cost. Servers probe what the default settings' probe plan asks (the full
mesh up to 24 servers, the bounded plan above); the last section runs N = 1,000
with both plans side by side on the same random draws.

    python bench/health_sim.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reconciler.health import HealthEngine
from reconciler.health.probing import probe_plan, witness_bound
from reconciler.health.simulate import Scenario, World, inline_topology
from reconciler.model.cluster import HealthSettings

SETTINGS = HealthSettings()
PLANS = {"full": SETTINGS.model_copy(update={"full_mesh_up_to": 10**6}), "bounded": SETTINGS}
F = SETTINGS.failure_streak
COUNTRIES = ["DE", "NL", "US", "FR", "GB", "RU", "JP", "SG", "FI", "PL", "CA", "AU", "TR", "BR", "IN", "SE"]


def fleet(n: int, probers: int = 0, per_country: int = 4) -> list[dict[str, object]]:
    """n servers, about `per_country` per country; the first `probers` are probers in RU."""
    k = max(1, min(len(COUNTRIES), n // per_country))
    servers = [{"name": f"s{i}", "country": COUNTRIES[i % k]} for i in range(n)]
    for i in range(probers):
        servers[i] = {"name": f"p{i}", "country": "RU", "prober": True}
    return servers


@dataclass
class Stats:
    server_ticks: int = 0
    false_out: int = 0  # healthy servers out of rotation (unreachable/blocked)
    false_unreachable: int = 0
    false_blocked: int = 0
    prober_target_ticks: int = 0
    changes: int = 0  # verdict changes (status or marks) per server
    naive_false: int = 0


def steady(n: int, ticks: int, seed: int, loss: float, burst: float | None = None, probers: int = 0,
           settings: HealthSettings = SETTINGS) -> Stats:
    """A healthy fleet under probe loss: every non-ok verdict is false."""
    events = [{"at": 0, "loss": {"p": loss, "burst": burst}}] if burst else []
    sc = Scenario.model_validate({"servers": fleet(n, probers), "ticks": ticks, "seed": seed,
                                  "loss": 0.0 if burst else loss, "events": events})
    topo = inline_topology(sc.servers)
    world, engine = World(sc, topo, 60.0, settings), HealthEngine(topo, settings)
    st = Stats()
    naive_fail = np.zeros((topo.n, topo.m), dtype=np.int16)
    prev_key = None
    for t in range(ticks):
        obs = world.observe(t)
        v = engine.evaluate(obs)
        st.server_ticks += n
        st.false_unreachable += int((v.status == 3).sum())
        st.false_blocked += int((v.status == 2).sum())
        st.false_out += int((~v.in_rotation).sum())
        st.prober_target_ticks += probers * (n - 1)
        marks = np.zeros(topo.m, dtype=np.int32)
        for _, tgt, _ in v.pair_marks:
            marks[tgt] += 1
        key = (v.status.copy(), marks)
        if prev_key is not None:
            st.changes += int(((key[0] != prev_key[0]) | (key[1] != prev_key[1])).sum())
        prev_key = key
        # Anchor: a fixed quorum of 3 witnesses with streaks >= F, no reliability or evidence tests.
        naive_fail = np.where(obs.probe_present, np.where(obs.probe_ok, 0, naive_fail + 1), naive_fail)
        np.fill_diagonal(naive_fail, 0)
        st.naive_false += int(((naive_fail >= F).sum(axis=0) >= 3).sum())
    return st


def detect(kind: str, n: int, seed: int, loss: float = 0.05, settings: HealthSettings = SETTINGS,
           at: int = 20, until: int = 40, burst: float | None = None) -> tuple[int | None, int | None]:
    """(ticks to detect, ticks to recover) for one fault; None = never. With ``burst``, the background loss is
    Gilbert-Elliott (share ``loss``, mean burst ``burst`` ticks) instead of independent."""
    servers = fleet(n, probers=1 if kind == "prober" else 0)
    names = [s["name"] for s in servers]
    target = names[-1]
    if kind == "outage":
        events, expect = [{"at": at, "until": until, "outage": target}], "unreachable"
    elif kind == "down":
        events, expect = [{"at": at, "until": until, "down": target}], "unavailable"
    elif kind == "country_block":  # the witnesses in the target's... other country (>= 3 there)
        country = servers[0]["country"]
        local = [s["name"] for s in servers if s["country"] == country][:max(3, n // 8)]
        target = next(s["name"] for s in reversed(servers) if s["country"] != country)
        events, expect = [{"at": at, "until": until, "block": {"from": local, "to": target}}], "unreachable"
    elif kind == "half_down":
        down = names[1::2]
        target = down[-1]
        events, expect = [{"at": at, "until": until, "outage": s} for s in down], "unreachable"
    elif kind == "prober":
        events, expect = [{"at": at, "until": until, "block": {"from": [names[0]], "to": target}}], "blocked"
    else:
        raise ValueError(kind)
    if burst is not None:
        events = [{"at": 0, "loss": {"p": loss, "burst": burst}}, *events]
    sc = Scenario.model_validate({"servers": servers, "ticks": until + 30, "seed": seed,
                                  "loss": 0.0 if burst is not None else loss, "events": events})
    topo = inline_topology(sc.servers)
    world, engine = World(sc, topo, 60.0, settings), HealthEngine(topo, settings)
    i = topo.servers.index(target)
    found = healed = None
    for t in range(sc.ticks):
        status = engine.evaluate(world.observe(t)).server_status[i]
        if found is None and t >= at and status == ["ok", "no_data", "blocked", "unreachable", "unavailable"].index(expect):
            found = t - at + 1
        if found is not None and healed is None and t >= until and status == 0:
            healed = t - until + 1
    return found, healed


def scenario_checks(seed: int) -> dict[str, object]:
    """Qualitative scenarios: lone server with/without prober, split pairs, isolated witness, silence, flapping."""
    out: dict[str, object] = {}

    def run(servers, events, ticks=60, loss=0.05):
        sc = Scenario.model_validate({"servers": servers, "ticks": ticks, "seed": seed, "loss": loss, "events": events})
        topo = inline_topology(sc.servers)
        world, engine = World(sc, topo, 60.0, SETTINGS), HealthEngine(topo, SETTINGS)
        return [engine.evaluate(world.observe(t)) for t in range(ticks)]

    base = [{"name": "ru-1", "country": "RU"}] + [{"name": f"d{i}", "country": c} for i, c in enumerate("DE DE NL US FR".split())]
    lone = run(base, [{"at": 5, "block": {"from": ["ru-1"], "to": "d2"}}])
    out["lone_without_prober_removed"] = any(not v.server("d2").in_rotation for v in lone)
    out["lone_without_prober_marked"] = bool(lone[-1].server("d2").marks)
    with_prober = [{**base[0], "prober": True}] + base[1:]
    lone_p = run(with_prober, [{"at": 5, "block": {"from": ["ru-1"], "to": "d2"}}])
    out["lone_with_prober_blocked"] = lone_p[-1].server("d2").status == "blocked"

    one_way = run(base, [{"at": 5, "block": {"from": ["d0"], "to": "d3"}}])
    m = one_way[-1].server("d3").marks
    out["split_one_way_ok"] = bool(m) and m[0].witness == "d0" and not m[0].both_directions and one_way[-1].server("d3").in_rotation
    two_way = run(base, [{"at": 5, "block": {"from": ["d0"], "to": "d3"}}, {"at": 5, "block": {"from": ["d3"], "to": "d0"}}])
    out["split_two_way_ok"] = all(two_way[-1].server(s).marks and two_way[-1].server(s).marks[0].both_directions
                                  for s in ("d0", "d3")) and all(v.in_rotation.all() for v in two_way)
    iso = run(fleet(10), [{"at": 3, "isolate": "s2"}], ticks=200)
    out["isolated_witness_false_verdicts"] = int(sum((v.status >= 2).sum() for v in iso))

    removals = 0
    for p in (0.3, 0.5, 0.7, 1.0):
        for v in run(fleet(20), [{"at": 0, "reports_missing": {"p": p}}], ticks=300):
            removals += int((~v.in_rotation).sum())
    out["silence_removals"] = removals

    flap = run(fleet(10), [{"at": 10, "until": 410, "flap": {"server": "s9", "period": 6}}], ticks=500)
    statuses = [int(v.server_status[9]) for v in flap]
    out["flapping_target_changes"] = sum(1 for a, b in zip(statuses, statuses[1:], strict=False) if a != b)
    out["flapping_target_undamped_changes"] = 2 * (400 // 12)
    out["flapping_target_heals"] = statuses[-1] == 0
    return out


# Fleets shaped like the ones operators run: two or three servers, one server alone in a censoring country,
# a prober there, a few countries (name, country, prober).
SMALL_FLEETS: dict[str, list[tuple[str, str, bool]]] = {
    "2 servers": [("de-1", "DE", False), ("nl-1", "NL", False)],
    "3 servers": [("de-1", "DE", False), ("nl-1", "NL", False), ("us-1", "US", False)],
    "3, prober in RU": [("ru-p", "RU", True), ("de-1", "DE", False), ("nl-1", "NL", False)],
    "4, one in RU": [("ru-1", "RU", False), ("de-1", "DE", False), ("nl-1", "NL", False), ("us-1", "US", False)],
    "8, prober in RU": [("ru-p", "RU", True)] + [(f"s{i}", c, False) for i, c in enumerate("DE NL US FR GB FI SE".split())],
    "10, three in RU": [("ru-p", "RU", True), ("ru-1", "RU", False), ("ru-2", "RU", False)]
                       + [(f"s{i}", c, False) for i, c in enumerate("DE DE NL US US FR GB".split())],
}
# (loss, mean burst in intervals): 5-20% loss, bursts up to 5 intervals; 10% in bursts of 4 is the case that once
# declared a healthy server blocked.
BURSTY = ((0.05, 2.0), (0.05, 5.0), (0.10, 4.0), (0.20, 2.0), (0.20, 5.0))


def bursty(quick: bool, log) -> dict[str, object]:
    """Gilbert-Elliott loss on fleets of 2..10 servers, with and without a prober, every fleet started cold for each
    seed (an engine that has learnt nothing yet is the easiest to fool): every blocked or unreachable verdict is
    false. Then real faults under the same loss: how long their detection takes."""
    target = 20_000 if quick else 100_000  # server-intervals per (loss, burst) with a prober, and as many without
    seeds = 2 if quick else 4
    out: dict[str, object] = {}
    total = false_blocked = false_unreachable = with_prober = 0
    worst: dict[str, int] = {}
    for p, burst in BURSTY:
        row = {"server_intervals": 0, "false_blocked": 0, "false_unreachable": 0}
        for name, shape in SMALL_FLEETS.items():
            prober = any(x[2] for x in shape)
            n = len(shape)
            share = target / sum(1 for s in SMALL_FLEETS.values() if any(x[2] for x in s) == prober)
            ticks = max(200, int(share / n / seeds))
            servers = [{"name": a, "country": c, "prober": pr} for a, c, pr in shape]
            for seed in range(seeds):
                sc = Scenario.model_validate({"servers": servers, "ticks": ticks, "seed": 1000 * seed + int(100 * p + burst),
                                              "events": [{"at": 0, "loss": {"p": p, "burst": burst}}]})
                topo = inline_topology(sc.servers)
                world, engine = World(sc, topo, 60.0, SETTINGS), HealthEngine(topo, SETTINGS)
                for t in range(ticks):
                    v = engine.evaluate(world.observe(t))
                    fb, fu = int((v.server_status == 2).sum()), int((v.server_status == 3).sum())
                    row["false_blocked"] += fb
                    row["false_unreachable"] += fu
                    if fb or fu:
                        worst[name] = worst.get(name, 0) + fb + fu
                row["server_intervals"] += ticks * n
                with_prober += ticks * n if prober else 0
        total += row["server_intervals"]
        false_blocked += row["false_blocked"]
        false_unreachable += row["false_unreachable"]
        log(f"  {p:4.0%} loss, mean burst {burst:g}: {row['server_intervals']:7d} server-intervals  false blocked "
            f"{row['false_blocked']}  false unreachable {row['false_unreachable']}")
    out["bursty_server_intervals"] = total
    out["bursty_server_intervals_with_prober"] = with_prober
    out["bursty_false_blocked"] = false_blocked
    out["bursty_false_unreachable"] = false_unreachable
    out["bursty_false_by_fleet"] = worst
    # Detection of real faults under bursty loss (10 and 50 servers, like the iid section): evidence adapts to the
    # loss, so a lone prober needs a longer streak where a burst of eight is ordinary.
    detections: dict[str, int] = {}
    misses = 0
    for p, burst in ((0.05, 2.0), (0.05, 5.0), (0.10, 4.0), (0.20, 5.0)):
        for kind in ("outage", "country_block", "prober"):
            for n in (10, 50):
                for seed in range(1 if quick else 2):
                    found, _ = detect(kind, n, seed + 1, loss=p, burst=burst, at=60, until=140)
                    key = f"{kind} {p:.0%}/{burst:g}"
                    if found is None:
                        misses += 1
                    else:
                        detections[key] = max(detections.get(key, 0), found)
    out["bursty_detection"] = detections
    out["bursty_detect_misses"] = misses
    quorum = [v for k, v in detections.items() if not k.startswith("prober")]
    out["bursty_detect_quorum_max"] = max(quorum) if quorum else None
    log(f"  detection under bursty loss (intervals from the first failed check): {detections}, misses {misses}")
    return out


def cost(n: int, reps: int, settings: HealthSettings = SETTINGS) -> tuple[float, float, float]:
    """(median tick ms, state MB, anchor ms: one np.where over the N x M mesh)."""
    sc = Scenario.model_validate({"servers": fleet(n, probers=2), "ticks": reps + 3, "seed": 1, "loss": 0.05})
    topo = inline_topology(sc.servers)
    world, engine = World(sc, topo, 60.0, settings), HealthEngine(topo, settings)
    observations = [world.observe(t) for t in range(reps + 3)]
    for o in observations[:3]:
        engine.evaluate(o)
    times = []
    for o in observations[3:]:
        t0 = time.perf_counter()
        engine.evaluate(o)
        times.append(time.perf_counter() - t0)
    fail = engine.state.fail
    anchor = []
    for o in observations[3:]:
        t0 = time.perf_counter()
        np.where(o.probe_ok, 0, fail + 1)
        anchor.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, engine.state.nbytes() / 2**20, statistics.median(anchor) * 1e3


def probes_per_server(n: int, settings: HealthSettings, intervals: int) -> dict[str, float]:
    """Probes per interval per server over `intervals` consecutive plans: ordinary servers and probers apart."""
    sc = Scenario.model_validate({"servers": fleet(n, probers=max(1, n // 50)), "ticks": 1})
    topo = inline_topology(sc.servers)
    ordinary = ~topo.prober_mask
    worst = mean = prober = 0.0
    witnesses_min = n
    for t in range(intervals):
        plan = probe_plan(topo, t, settings)
        probes = plan.probes_per_server(topo)
        worst = max(worst, float(probes[ordinary].max()))
        mean += float(probes[ordinary].mean()) / intervals
        prober = max(prober, float(probes[~ordinary].max()))
        witnesses_min = min(witnesses_min, int(plan.pairs.sum(axis=0).min()))
    return {"max": worst, "mean": mean, "prober": prober, "witnesses_min": witnesses_min}


def plans_side_by_side(quick: bool, log) -> dict[str, object]:
    """N = 1,000 with the full mesh and with the bounded plan, on the same random draws."""
    n = 1000
    out: dict[str, object] = {}
    ticks = 40 if quick else 120
    seeds = [1] if quick else [1, 2, 3]
    rows: dict[str, dict[str, object]] = {}
    for name, settings in PLANS.items():
        row: dict[str, object] = {}
        t0 = time.perf_counter()
        for key, loss in (("loss5", 0.05), ("loss20", 0.2)):
            st = steady(n, ticks, seed=11, loss=loss, probers=n // 50, settings=settings)
            row[f"false_unreachable_{key}"] = st.false_unreachable
            row[f"false_blocked_{key}"] = st.false_blocked
            row[f"server_ticks_{key}"] = st.server_ticks
        detections: dict[str, int] = {}
        misses = 0
        for kind in ("outage", "down", "country_block", "half_down", "prober"):
            for seed in seeds:
                # The fault starts at a different phase of the sample's rotation for each seed.
                found, _ = detect(kind, n, seed, settings=settings, at=10 + 5 * seed, until=22 + 5 * seed)
                if found is None:
                    misses += 1
                else:
                    detections[kind] = max(detections.get(kind, 0), found)
        row["detection_intervals"] = max(v for k, v in detections.items() if k != "prober") if detections else None
        row["detection_by_kind"] = detections
        row["detection_prober_intervals"] = detections.get("prober")
        row["detect_misses"] = misses
        probes = probes_per_server(n, settings, intervals=4 if quick else 64)
        row["probes_per_server"] = probes["max"]
        row["probes_per_server_mean"] = probes["mean"]
        row["probes_per_prober"] = probes["prober"]
        row["witnesses_per_target_min"] = probes["witnesses_min"]
        ms, mb, _ = cost(n, reps=5 if quick else 15, settings=settings)
        row["tick_ms"] = ms
        row["state_mb"] = mb
        row["seconds"] = time.perf_counter() - t0
        rows[name] = row
        for k, v in row.items():
            out[f"{name}_{k}_n1000"] = v
        log(f"  {name:8s} false unreachable 5% {row['false_unreachable_loss5']} / 20% {row['false_unreachable_loss20']}  "
            f"false blocked {row['false_blocked_loss5']} / {row['false_blocked_loss20']}  detect max "
            f"{row['detection_intervals']} {detections} misses {misses}  probes/server max {probes['max']:.0f} "
            f"mean {probes['mean']:.1f} (prober {probes['prober']:.0f}), witnesses/target >= {probes['witnesses_min']}  "
            f"engine {ms:.1f} ms/interval  ({row['seconds']:.0f} s)")
    out["bounded_probe_bound"] = witness_bound(SETTINGS)
    out["plans_ticks_n1000"] = ticks
    out["plans_seeds_n1000"] = len(seeds)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer ticks and seeds (under a minute)")
    ap.add_argument("--json", action="store_true", help="one JSON object with every figure")
    args = ap.parse_args()
    t_start = time.perf_counter()
    # Ticks per fleet size: enough server-ticks per loss level (>= 1e5 in the full run).
    plan = {10: 1500, 50: 300, 200: 75, 1000: 15} if args.quick else {10: 4000, 50: 1000, 200: 250, 1000: 60}
    seeds = [1, 2] if args.quick else [1, 2, 3, 4, 5]
    rows = []
    result: dict[str, object] = {}

    def log(msg: str) -> None:
        if not args.json:
            print(msg, flush=True)

    log("== steady fleets under probe loss (every out-of-rotation verdict is false)")
    for label, loss, burst in (("iid 5%", 0.05, None), ("iid 20%", 0.2, None), ("bursty 20% (mean burst 3)", 0.2, 3.0)):
        total = Stats()
        for n, ticks in plan.items():
            if burst and n == 1000:
                continue
            st = steady(n, ticks, seed=7, loss=loss, burst=burst, probers=max(1, n // 50))
            rows.append((label, n, ticks, st))
            for k in vars(total):
                setattr(total, k, getattr(total, k) + getattr(st, k))
            log(f"  {label:28s} N={n:5d} ticks={ticks:5d}  false unreachable {st.false_unreachable:4d}  "
                f"false blocked {st.false_blocked:3d}  changes/1000/server {1000 * st.changes / st.server_ticks:6.3f}  "
                f"naive quorum-of-3 false {st.naive_false / st.server_ticks:7.2%}")
        key = {"iid 5%": "5", "iid 20%": "20", "bursty 20% (mean burst 3)": "bursty"}[label]
        result[f"server_ticks_{key}"] = total.server_ticks
        result[f"false_unreachable_rate_{key}"] = total.false_unreachable / total.server_ticks
        result[f"false_blocked_{key}"] = total.false_blocked
        result[f"prober_target_ticks_{key}"] = total.prober_target_ticks
        result[f"flaps_per_1000_{key}"] = 1000 * total.changes / total.server_ticks
        result[f"naive_quorum3_false_rate_{key}"] = total.naive_false / total.server_ticks
    result["false_unreachable_rate"] = max(result["false_unreachable_rate_5"], result["false_unreachable_rate_20"])
    result["false_unreachable_rate_bursty"] = result["false_unreachable_rate_bursty"]
    blocked = result["false_blocked_20"] + result["false_blocked_5"]
    result["false_blocked_rate"] = blocked / (result["prober_target_ticks_20"] + result["prober_target_ticks_5"])
    result["flaps_per_1000"] = result["flaps_per_1000_20"]
    n200 = next(st for label, n, _, st in rows if label == "iid 20%" and n == 200)
    result["naive_quorum3_false_rate_n200_20"] = n200.naive_false / n200.server_ticks

    log("== detection and recovery (5% background loss; ticks counted from the first failed check)")
    detections: dict[str, list[int]] = {}
    recoveries: list[int] = []
    misses = 0
    for kind in ("outage", "down", "country_block", "half_down", "prober"):
        for n in (10, 50):
            for seed in seeds:
                found, healed = detect(kind, n, seed)
                if found is None:
                    misses += 1
                    continue
                detections.setdefault(kind, []).append(found)
                if healed is not None:
                    recoveries.append(healed)
        d = detections.get(kind, [])
        log(f"  {kind:14s} detect max {max(d) if d else '-':>3}  median {statistics.median(d) if d else '-':>4}")
    quorum_kinds = ("outage", "down", "country_block", "half_down")
    result["detect_ticks_max"] = max(max(detections[k]) for k in quorum_kinds)
    result["detect_ticks_prober_max"] = max(detections.get("prober", [0]))
    result["recover_ticks_max"] = max(recoveries)
    result["detect_misses"] = misses
    log(f"  detect_ticks_max {result['detect_ticks_max']} (target <= {F + 1}), prober {result['detect_ticks_prober_max']} "
        f"(prober_streak {SETTINGS.prober_streak}), recover max {result['recover_ticks_max']}, misses {misses}")

    log("== scenarios")
    checks = scenario_checks(seed=3)
    for k, v in checks.items():
        log(f"  {k:36s} {v}")
    result.update(checks)

    log("== bursty loss (Gilbert-Elliott) on the fleets operators run, each started cold (every blocked/unreachable is false)")
    result.update(bursty(args.quick, log))

    log("== probe plans at N = 1000, side by side (same random draws; 5% loss for detection)")
    result.update(plans_side_by_side(args.quick, log))

    log("== cost")
    ms, mb, anchor = cost(1000, reps=5 if args.quick else 15)
    result["tick_ms_n1000"] = ms
    result["state_mb_n1000"] = mb
    result["anchor_where_ms_n1000"] = anchor
    result["tick_over_anchor"] = ms / anchor
    log(f"  N=1000 full mesh (10^6 probe results): {ms:.1f} ms per evaluation ({ms / anchor:.0f}x one np.where "
        f"over the mesh, {anchor:.2f} ms), state {mb:.2f} MB")
    result["quick"] = args.quick
    result["seconds"] = time.perf_counter() - t_start

    targets = {
        "false_unreachable_rate": (result["false_unreachable_rate"], "== 0"),
        "false_unreachable_rate_bursty": (result["false_unreachable_rate_bursty"], "<= 1e-4"),
        "false_blocked_rate": (result["false_blocked_rate"], "<= 1e-5"),
        "detect_ticks_max": (result["detect_ticks_max"], f"<= {F + 1}"),
        "silence_removals": (result["silence_removals"], "== 0"),
        "bursty_false_blocked": (result["bursty_false_blocked"], "== 0"),
        "bursty_false_unreachable": (result["bursty_false_unreachable"], "== 0"),
        "bursty_server_intervals_with_prober": (result["bursty_server_intervals_with_prober"], ">= 1e5"),
        "flaps_per_1000": (result["flaps_per_1000"], "<= 1"),
        "tick_ms_n1000": (result["tick_ms_n1000"], "<= 50"),
        "state_mb_n1000": (result["state_mb_n1000"], "<= 16"),
        "bounded_false_unreachable_loss5_n1000": (result["bounded_false_unreachable_loss5_n1000"], "== 0"),
        "bounded_false_unreachable_loss20_n1000": (result["bounded_false_unreachable_loss20_n1000"], "== 0"),
        "bounded_detection_intervals_n1000": (result["bounded_detection_intervals_n1000"], f"<= {F + 1}"),
        "bounded_detect_misses_n1000": (result["bounded_detect_misses_n1000"], "== 0"),
        "bounded_probes_per_server_n1000": (result["bounded_probes_per_server_n1000"],
                                            f"<= {result['bounded_probe_bound']}"),
    }
    met = {k: bool(eval(f"{v!r} {cond}")) for k, (v, cond) in targets.items()}  # our own literals
    result["targets_met"] = met
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("== targets")
        for k, (v, cond) in targets.items():
            print(f"  {k:32s} {v:<12.4g} {cond:10s} {'met' if met[k] else 'MISSED'}")
        print(f"  ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
