"""CLI start-up benchmark: how long `reconciler --version`, `--help` and a command's `--help` take to start.

Each command module imports its own libraries when it runs (``reconciler.cli.commands`` names them all without
importing any), so a command the operator does not run costs nothing. Measured here, in the same run:

- anchor: ``python -c pass`` with the same interpreter — the floor of starting Python at all;
- ``python -m reconciler --version`` and ``--help``: the target is ≤ 0.3 s each;
- ``validate --help`` and ``run --help``: one command's module and its imports (informative);
- the same ``--version`` with every command module imported first: what start-up cost before they were lazy.

Every case runs once per round, in an order that rotates each round (``bench/harness.py``); a round's figure is
the median wall time of ``--runs`` starts of it. Figures: each case's median over the rounds, its ratio to the
anchor round by round (median and spread), and the machine.

    python bench/cli_start.py [--rounds 5] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402

TARGET_S = 0.3
EAGER = ("import importlib, sys; from reconciler.cli.commands import COMMANDS; "
         "[importlib.import_module('reconciler.cli.' + m) for m in {m for m, _ in COMMANDS.values()}]; "
         "from reconciler.cli import main; sys.exit(main(['--version']))")


def timed(argv: list[str], runs: int) -> float:
    """The median wall time of ``runs`` starts of ``argv`` (output discarded; a failure stops the benchmark)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT,
                       timeout=60)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (at least 3)")
    ap.add_argument("--runs", type=int, default=3, help="starts of each case per round (the round's figure: their median)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    py = sys.executable
    cases = {
        "anchor_python": [py, "-c", "pass"],
        "version": [py, "-m", "reconciler", "--version"],
        "help": [py, "-m", "reconciler", "--help"],
        "validate_help": [py, "-m", "reconciler", "validate", "--help"],
        "run_help": [py, "-m", "reconciler", "run", "--help"],
        "version_all_commands_imported": [py, "-c", EAGER],
    }
    machine = harness.machine({"python -c pass": platform.python_version()})
    timed(cases["version"], 2)  # warm the file cache and the bytecode
    contenders = {name: (lambda argv=argv: timed(argv, args.runs)) for name, argv in cases.items()}
    rounds = harness.interleaved(contenders, args.rounds, "anchor_python", None if args.json else harness.stderr)
    seconds = {k: v["median"] for k, v in rounds["values"].items()}
    figures = {
        "machine": machine,
        "runs": args.runs,
        "seconds": seconds,  # the medians of the rounds
        "ratio_to_anchor": {k: round(v["median"], 2) for k, v in rounds["ratios"].items()},
        **rounds,  # rounds, anchor, values and ratios: every round, its median and spread
        "target_s": TARGET_S,
        "targets_met": seconds["version"] <= TARGET_S and seconds["help"] <= TARGET_S,
    }
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        for k, v in seconds.items():
            ratio = rounds["ratios"].get(k)
            shown = "" if ratio is None else f"  ({ratio['median']:.1f}× python -c pass, spread {ratio['spread']:.1%})"
            print(f"{k:32s} {v * 1000:7.0f} ms{shown}")
        print(f"--version and --help within {TARGET_S} s: {'yes' if figures['targets_met'] else 'NO'} "
              f"(medians of {args.rounds} rounds; {machine['cpu_model']}, {machine['cpus']} CPUs)")
    return 0 if figures["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
