"""What an interval tells (fleet.tell), a pure reconciler: exercised over thousands of intervals of a small fleet
with one server alone in a censoring country, bursty loss and users crossing their limits and coming back."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from reconciler.fleet import Learned, snapshot
from reconciler.fleet.tell import Told, tell
from reconciler.model import Cluster, UserUsage
from tests.test_loop import report

GB = 1_000_000_000


def fleet() -> Cluster:
    servers = [{"name": f"s{i}", "host": f"198.18.0.{10 + i}", "country": country,
                "inbounds": [{"id": f"s{i}-in", "name": f"S{i}", "protocol": "shadowsocks-2022", "port": 8388, "route": "r"}]}
               for i, country in enumerate(("DE", "NL", "RU"))]
    users = [{"name": f"u{j}", "data_limit": "1GB"} for j in range(6)]
    return Cluster.model_validate({"servers": servers, "routes": [{"id": "r", "name": "R"}], "users": users,
                                   "settings": {"health": {"report_interval": "10s"}}})


def test_over_thousands_of_intervals_each_change_is_told_once_and_a_plan_asked_exactly_when_users_change():
    # spec: HEALTH-13 — a verdict's event once per change; users out or back apply at once
    c = fleet()
    learned = Learned.fresh(c)
    rng = np.random.default_rng(11)
    used = {u.name: 0 for u in c.users}
    state, start = Told(), 1.8e9
    plans = posts = 0
    kinds: set[str] = set()
    changes = 0
    bursty = False
    for k in range(2000):
        now = start + 10 * k
        bursty = rng.random() < (0.9 if bursty else 0.03)  # loss comes in bursts
        # RU's server is cut off from the others half the time, in long stretches; the rest lose probes in bursts.
        censored = (k // 150) % 2 == 1
        reports = {}
        for s in c.servers:
            failing = {"s2-in"} if censored and s.name != "s2" else set()
            if bursty:
                failing |= {r.inbound.id for r in c.inbounds if rng.random() < 0.3}
            # Now and then RU's server cannot be reached by the controller either: no report from it.
            reports[s.name] = None if s.name == "s2" and (k // 400) % 3 == 2 else report(s.name, c, now, failing=failing)
        verdicts = learned.fold(c, reports, now)
        for name in used:  # usage wanders over and under the limit (a reset brings a user back)
            used[name] = 0 if rng.random() < 0.01 else used[name] + int(rng.integers(0, GB // 20))
        snap = dataclasses.replace(snapshot(c, learned, {}, now, verdicts),
                                   usage={n: UserUsage(down=b) for n, b in used.items()})
        before = copy.deepcopy(state)
        new, effects = tell(state, verdicts, snap, k + 1)
        assert state == before  # pure: the state given is not changed
        assert tell(before, verdicts, snap, k + 1) == (new, effects)  # and the same inputs tell the same
        withheld_changed = state.withheld is not None and dict(new.withheld or {}) != dict(state.withheld)
        assert effects.plan_now == withheld_changed
        assert sum(line.startswith(f"interval {k + 1}: ") for _, line in effects.logs) == 1
        # A server's status change is logged once, when it changes; a verdict event only when its label changed.
        changed = {n for n, s in new.status.items() if state.status.get(n) not in (None, s)}
        assert {line.split(":")[0] for level, line in effects.logs if " → " in line} == changed
        changes += len(changed)
        for p in effects.posts:
            if p["subject"].startswith("s"):
                assert state.labels.get(p["subject"]) != new.labels.get(p["subject"]), p
        plans += effects.plan_now
        posts += len(effects.posts)
        kinds.update(p["event"] for p in effects.posts)
        state = new
    assert plans > 5 and posts > 5  # it did tell, and ask
    assert {"quota_warning", "quota_reached", "fleet_degraded"} <= kinds and changes >= 4, (kinds, changes)
