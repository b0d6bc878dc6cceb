"""The verdict tick at N = 1,000: one ``HealthEngine.evaluate`` of a whole fleet's probe results, with the bounded
probe plan (the default settings) and with the full mesh, against one ``np.where`` over the N × M mesh (the anchor:
the least any dense evaluation does).

The fleet is ``bench/health_sim.py``'s: 16 countries, a prober per 50 servers, one inbound per server, 5% iid
loss. Each round evaluates the same 15 observations (after 3 of warm-up) for each contender, the contenders in an
order that rotates each round (``bench/harness.py``); a round's figure is its median in milliseconds. Target: the
bounded plan's tick ≤ 10 ms.

    python bench/verdict_tick.py [--rounds 5] [--n 1000] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402
from health_sim import PLANS, fleet  # noqa: E402

from reconciler.health.engine import HealthEngine  # noqa: E402
from reconciler.health.simulate import Scenario, World, inline_topology  # noqa: E402

TARGET_MS = 10.0
WARM, REPS = 3, 15


def contenders(n: int) -> dict[str, object]:
    scenario = Scenario.model_validate({"servers": fleet(n, probers=max(1, n // 50)), "ticks": WARM + REPS, "seed": 1,
                                        "loss": 0.05})
    topo = inline_topology(scenario.servers)
    out: dict[str, object] = {}
    fail = None
    for name, settings in PLANS.items():
        world = World(scenario, topo, 60.0, settings)
        observations = [world.observe(t) for t in range(WARM + REPS)]

        def tick(observations=observations, settings=settings) -> float:  # type: ignore[no-untyped-def]
            engine = HealthEngine(topo, settings)  # each round from the same start: the same work
            for o in observations[:WARM]:
                engine.evaluate(o)
            times = []
            for o in observations[WARM:]:
                t0 = time.perf_counter()
                engine.evaluate(o)
                times.append(time.perf_counter() - t0)
            return statistics.median(times) * 1e3

        out[name] = tick
        fail = np.zeros((topo.n, topo.m), np.int16) if fail is None else fail
        if name == "full":
            def anchor(observations=observations, fail=fail) -> float:  # type: ignore[no-untyped-def]
                times = []
                for o in observations[WARM:]:
                    t0 = time.perf_counter()
                    np.where(o.probe_ok, 0, fail + 1)
                    times.append(time.perf_counter() - t0)
                return statistics.median(times) * 1e3
            out["anchor"] = anchor
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    doc = {"machine": harness.machine({"numpy": np.__version__}), "n": args.n}
    log = None if args.json else harness.stderr
    doc |= harness.interleaved(contenders(args.n), args.rounds, "anchor", log)  # type: ignore[arg-type]
    bounded = doc["values"]["bounded"]["median"]
    doc["target_ms"] = TARGET_MS
    doc["targets_met"] = bounded <= TARGET_MS
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        v, r = doc["values"], doc["ratios"]
        for name in ("anchor", "bounded", "full"):
            ratio = f", × {r[name]['median']} the anchor (spread {r[name]['spread']})" if name in r else ""
            print(f"{name:>8}: {v[name]['median']:.2f} ms median of {args.rounds} rounds "
                  f"({v[name]['min']:.2f}–{v[name]['max']:.2f}){ratio}")
        print(f"the bounded plan's tick: {bounded:.2f} ms (target ≤ {TARGET_MS:g} ms: "
              f"{'met' if doc['targets_met'] else 'NOT met'}); {doc['machine']['cpu_model']}, {doc['machine']['cpus']} CPUs")
    return 0 if doc["targets_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
