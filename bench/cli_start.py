"""CLI start-up benchmark: how long `reconciler --version`, `--help` and a command's `--help` take to start.

Each command module imports its own libraries when it runs (``reconciler.cli.commands`` names them all without
importing any), so a command the operator does not run costs nothing. Measured here, in the same run:

- anchor: ``python -c pass`` with the same interpreter — the floor of starting Python at all;
- ``python -m reconciler --version`` and ``--help``: the target is ≤ 0.3 s each;
- ``validate --help`` and ``run --help``: one command's module and its imports (informative);
- the same ``--version`` with every command module imported first: what start-up cost before they were lazy.

Figures: the median wall time of N runs of each, and its ratio to the anchor.

    python bench/cli_start.py [--runs N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
    ap.add_argument("--runs", type=int, default=15)
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
    timed(cases["version"], 2)  # warm the file cache and the bytecode
    seconds = {name: timed(argv, args.runs) for name, argv in cases.items()}
    anchor = seconds["anchor_python"]
    figures = {
        "runs": args.runs,
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "ratio_to_anchor": {k: round(v / anchor, 2) for k, v in seconds.items() if k != "anchor_python"},
        "target_s": TARGET_S,
        "targets_met": seconds["version"] <= TARGET_S and seconds["help"] <= TARGET_S,
    }
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        for k, v in seconds.items():
            ratio = "" if k == "anchor_python" else f"  ({v / anchor:.1f}× python -c pass)"
            print(f"{k:32s} {v * 1000:7.0f} ms{ratio}")
        print(f"--version and --help within {TARGET_S} s: {'yes' if figures['targets_met'] else 'NO'}")
    return 0 if figures["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
