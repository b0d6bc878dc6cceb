"""Rollouts in waves: ``apply --wave 1,25%,rest`` or ``settings.rollout``.

The servers with changes are split into waves in the order of the file (``1``: one server; ``25%``: a quarter
of them, at least one; ``rest``: the others). Each wave is applied in parallel with its old files kept on the
servers; after ``settle`` seconds every server of the wave is judged by its own report, as the loop judges a
self-report (HEALTH-2: the engine active and every inbound's port listening). A wave that passes drops the
kept files and the next wave starts; a wave where any server failed (its commit, or the judgment) is rolled
back whole — every server of it restores its old files and restarts — and no later wave is touched.

Engine upgrades roll out this way by default (``DEFAULT``), whatever the file says, unless ``--wave all``.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable
from dataclasses import replace

from reconciler.apply.run import ServerResult, apply_one
from reconciler.engine import remote
from reconciler.errors import InvalidInput, RemoteError
from reconciler.plan.observe import Observed, gather
from reconciler.ssh import Runner
from reconciler.ssh.runner import answer

DEFAULT = "1,25%,rest"
_STEP = re.compile(r"^(\d+)(%?)$")


def parse(spec: str) -> list[str]:
    """``1,25%,rest`` → its steps; ``InvalidInput`` saying what is wrong."""
    steps = [x.strip() for x in spec.split(",") if x.strip()]
    if spec.strip() == "all":
        return ["rest"]
    for i, step in enumerate(steps):
        m = _STEP.match(step)
        if step == "rest" and i == len(steps) - 1:
            continue
        if m is None or int(m.group(1)) == 0 or (m.group(2) and int(m.group(1)) > 100):
            raise InvalidInput(f"--wave {spec!r}: {step!r} is not a wave; write counts, percentages and a final "
                               "`rest`, e.g. 1,25%,rest (or `all`)")
    return steps or ["rest"]


def partition(observed: list[Observed], steps: list[str]) -> list[list[Observed]]:
    """The waves: servers with changes in file order; the rest (nothing to do) ride with the last wave."""
    todo = [o for o in observed if o.plan.actions and not o.plan.error and not o.plan.problems]
    idle = [o for o in observed if o not in todo]
    waves: list[list[Observed]] = []
    left, total = list(todo), len(todo)
    for step in steps:
        if not left:
            break
        if step == "rest":
            size = len(left)
        elif step.endswith("%"):
            size = max(1, math.ceil(total * int(step[:-1]) / 100))
        else:
            size = int(step)
        waves.append(left[:size])
        left = left[size:]
    if left:
        waves.append(left)
    if idle:
        if not waves:
            waves.append([])
        waves[-1].extend(idle)
    return waves


def upgrades_engine(observed: list[Observed]) -> bool:
    return any(a.kind == "install-engine" and a.sign == "~" for o in observed for a in o.plan.actions)


async def judge(runner: Runner, o: Observed) -> str:
    """Why the server is not serving (empty: it is): its engine active and its inbounds' ports listening."""
    assert o.desired is not None
    try:
        facts = await gather(runner, o.target, o.desired)
    except RemoteError as exc:
        return f"cannot be observed: {exc}"
    if facts.active != "active":
        return f"the engine is {facts.active or 'not running'}"
    have = {(x.port, x.proto) for x in facts.listeners}
    missing = [f"{p}/{t}" for p, t in o.desired.listeners if (p, t) not in have]
    return f"not listening on {', '.join(missing)}" if missing else ""


async def _settle(runner: Runner, o: Observed, result: ServerResult, mode: str, verify_timeout: float) -> bool:
    commit = result.details.get("commit")
    swapped = commit.get("swapped") if isinstance(commit, dict) else None
    if not isinstance(swapped, list) or o.desired is None:
        return mode == "forget"
    engine = o.desired.engine
    req = {"mode": mode, "swapped": swapped, "service": engine.service, "config": engine.config, "binary": engine.binary,
           "listeners": [list(x) for x in o.desired.listeners], "verify_timeout": verify_timeout}
    try:
        res = await runner.script(o.target, remote.COMMIT, req, timeout=verify_timeout * 2 + 60)
        return bool(answer(res, o.target, remote.COMMIT, {"ok": bool})["ok"])
    except RemoteError:
        return False


async def apply_in_waves(observed: list[Observed], runner: Runner, progress: Callable[[str, str], None], spec: str,
                         settle: float = 5.0, verify_timeout: float = 20.0,
                         say: Callable[[str], None] = lambda _: None) -> list[ServerResult]:
    """Every server's plan, wave after wave (see the module's docstring); one result per server, in order."""
    waves = partition(observed, parse(spec))
    results: dict[str, ServerResult] = {}
    for n, wave in enumerate(waves, 1):
        say(f"wave {n}/{len(waves)}: {', '.join(o.plan.server for o in wave)}")
        done = await asyncio.gather(*(apply_one(o, runner, progress, verify_timeout, keep_backups=True) for o in wave))
        if settle and any(r.changed for r in done):
            await asyncio.sleep(settle)
        verdicts = await asyncio.gather(*(judge(runner, o) if r.ok and r.changed and o.desired else _ok()
                                          for o, r in zip(wave, done, strict=True)))
        failed = [(o, r, why) for o, r, why in zip(wave, done, verdicts, strict=True) if not r.ok or why]
        mode = "restore" if failed else "forget"
        for o, r in zip(wave, done, strict=True):
            if r.ok and r.changed:
                restored = await _settle(runner, o, r, mode, verify_timeout)
                if mode == "restore":
                    why = next((w for x, _, w in failed if x is o), "")
                    r = replace(r, ok=False, rolled_back=True, message=(f"{why}: " if why else "")
                                + f"wave {n} rolled back" + ("" if restored else " (restore not verified)"))
            results[o.plan.server] = r
        for o, r, why in failed:
            if why and r.ok is False and not r.rolled_back:
                results[o.plan.server] = replace(r, message=f"{why}: {r.message}")
        if failed:
            say(f"wave {n} failed ({', '.join(o.plan.server for o, _, _ in failed)}): rolled back; later waves untouched")
            for later in waves[n:]:
                for o in later:
                    results[o.plan.server] = ServerResult(o.plan.server, ok=False, phase="waiting",
                                                          message=f"not applied: wave {n} failed and was rolled back")
            break
    return [results[o.plan.server] for o in observed]


async def _ok() -> str:
    return ""
