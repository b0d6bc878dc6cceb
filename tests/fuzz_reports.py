"""A mutation fuzzer for agent reports: real reports with flipped bytes, cut ends, swapped types, huge and
non-finite numbers and deep nesting. Every input must parse or be refused with ``ReportError`` (nothing
else), within a time bound, and whatever parses must fold into the learned state and save.

    python -m tests.fuzz_reports 100000     # the long run; prints inputs, refused, parsed, tracebacks, slowest
``tests/test_hostile_reports.py`` runs a few thousand of the same inputs in every ``make test``.
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback

from reconciler.errors import ReportError
from reconciler.fleet import Learned, parse_report
from tests.test_loop import agent_json, cluster

CLUSTER = cluster(3, users=2)
SEEDS = [
    agent_json(probes={"s1-in": {"ok": True, "rtt_ms": 3.0}, "s2-in": {"ok": False, "error": "timeout"}},
               users=("alice", "bob"), traffic=(10, 20)),
    agent_json(traffic=None, service="failed", listeners={"443/tcp": False}),
]
ODD_VALUES = [None, True, False, 0, -1, 2**64, -(2**70), 1e308, -0.0, "", "x" * 300, [], {}, [1, [2]], {"a": {"b": None}},
              "NaN", "Infinity"]


def mutate(rng: random.Random) -> str:
    text = rng.choice(SEEDS)
    kind = rng.randrange(6)
    if kind == 0:  # flip bytes
        raw = bytearray(text.encode())
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return raw.decode(errors="replace")
    if kind == 1:  # cut
        return text[: rng.randrange(len(text))]
    if kind == 2:  # swap a field's value for an odd one, at the top or one level down
        doc = json.loads(text)
        key = rng.choice(list(doc))
        if isinstance(doc[key], dict) and doc[key] and rng.random() < 0.6:
            sub = rng.choice(list(doc[key]))
            doc[key][sub] = rng.choice(ODD_VALUES)
        else:
            doc[key] = rng.choice(ODD_VALUES)
        return json.dumps(doc)
    if kind == 3:  # non-finite numbers, as Python's json writes them
        return text.replace("3.0", rng.choice(["NaN", "Infinity", "-Infinity", "1e999"]), 1)
    if kind == 4:  # nesting
        depth = rng.choice([10, 1000, 50_000])
        return text.replace('"probes": {', '"probes": {"deep": ' + "[" * depth + "]" * depth + ", ", 1)
    return "\n".join([text, text[::-1], "{" * rng.randint(1, 5)][: rng.randint(1, 3)])  # several lines


def run(n: int, seed: int = 1) -> dict[str, float]:
    rng = random.Random(seed)
    refused = parsed = 0
    failures: list[str] = []
    slowest = 0.0
    for _ in range(n):
        text = mutate(rng)
        start = time.perf_counter()
        try:
            rep = parse_report("s0", text, 1e9)
            learned = Learned.fresh(CLUSTER)
            learned.fold(CLUSTER, {"s0": rep, "s1": None, "s2": None}, 1e9)
            learned.to_bytes()
            parsed += 1
        except ReportError:
            refused += 1
        except Exception:  # noqa: BLE001 — what the fuzzer looks for
            failures.append(traceback.format_exc(limit=3) + f"\ninput: {text[:300]!r}")
        slowest = max(slowest, time.perf_counter() - start)
    if failures:
        print(failures[0], file=sys.stderr)
    return {"inputs": n, "refused": refused, "parsed": parsed, "tracebacks": len(failures), "slowest_s": round(slowest, 4)}


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    t0 = time.perf_counter()
    result = run(count)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))
    sys.exit(1 if result["tracebacks"] else 0)
