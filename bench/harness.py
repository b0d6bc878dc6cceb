"""What every benchmark reports the same way: the machine it ran on, rounds run interleaved (each contender once
per round, in an order that rotates, so a machine that slows down mid-run slows every contender alike), each
round's ratio to the anchor measured in that round, and the median and spread of the rounds, in one JSON
document.

A figure quoted in docs/benchmarks.md is a ``median`` of at least three rounds of one run, given with its
``spread``: (max − min) / median of the rounds.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
from collections.abc import Callable, Mapping
from typing import Any


def machine(anchors: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The CPU model and count, the load before the run, the interpreter and the anchors' versions."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu_model": model or platform.processor() or "unknown", "cpus": os.cpu_count(),
            "load_before": [round(x, 2) for x in os.getloadavg()], "kernel": platform.release(),
            "python": platform.python_version(), "anchors": dict(anchors or {})}


def summary(values: list[float], digits: int = 4) -> dict[str, Any]:
    """Median, least, most and spread ((max − min) / median) of a figure's rounds, and the rounds themselves."""
    median = statistics.median(values)
    spread = (max(values) - min(values)) / median if median else 0.0
    return {"median": round(median, digits), "min": round(min(values), digits), "max": round(max(values), digits),
            "spread": round(spread, 3), "rounds": [round(v, digits) for v in values]}


def interleaved(contenders: Mapping[str, Callable[[], float]], rounds: int, anchor: str,
                log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every contender once per round (the order rotating each round); each returns its figure for the round
    (seconds, milliseconds: the same unit for all). The result: each contender's figures and its ratio to
    ``anchor`` round by round, summarized."""
    if anchor not in contenders:
        raise ValueError(f"the anchor {anchor!r} is not a contender")
    if rounds < 3:
        raise ValueError("a figure is the median of at least three rounds")
    names = list(contenders)
    values: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            values[name].append(float(contenders[name]()))
        if log is not None:
            log(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {values[n][-1]:.4g}" for n in names))
    ratios = {n: [v / a if a else float("inf") for v, a in zip(values[n], values[anchor], strict=True)]
              for n in names if n != anchor}
    return {"rounds": rounds, "anchor": anchor, "values": {n: summary(v) for n, v in values.items()},
            "ratios": {n: summary(v, 3) for n, v in ratios.items()}}


def stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
