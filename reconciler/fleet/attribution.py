"""Which route and server a user's counted bytes belong to (pure): the route whose inbound the user is assigned on
that server, for the per-route figures, and whether a server serves a user at all (its reports count for them)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from reconciler.balance.assignments import Assignments
from reconciler.balance.decide import route_of_key
from reconciler.model import Cluster
from reconciler.model.roster import Roster

# Per route key (in the assignments' order): the server index each user is assigned to on it (-1: none).
RouteServers = list[tuple[str, np.ndarray]]


def served_by(routes: RouteServers, server: int) -> Callable[[np.ndarray], np.ndarray]:
    """Whether each of the given users (indices; -1: nobody) is assigned to ``server`` on some route."""
    def check(users: np.ndarray) -> np.ndarray:
        ok = np.zeros(len(users), bool)
        safe = np.maximum(users, 0)
        for _key, where in routes:
            ok |= where[safe] == server
        return ok & (users >= 0)
    return check




def routes_on_servers(cluster: Cluster, assignments: Mapping[tuple[str, str], str], roster: Roster) -> RouteServers:
    """Which route each user's bytes on each server count for (metrics per route): the route whose inbound the
    user is assigned on that server (the first such route in the assignments' order)."""
    if not assignments:
        return []
    server_of = cluster.server_index_of_inbound
    held = Assignments.of(assignments, roster.names, cluster.inbound_ids, roster.index)  # one lookup per route key
    to_server = np.array([server_of[t] for t in held.inbounds] + [-1], np.int64)  # [-1]: nobody's
    return [(key, to_server[col]) for key, col in held.columns.items()]


def count_routes(by_route: dict[str, list[int]], routes: RouteServers, server: int, user: np.ndarray,
                  side: np.ndarray, got: np.ndarray) -> None:
    claimed = np.zeros(len(user), bool)
    safe = np.maximum(user, 0)
    for key, where in routes if server >= 0 else ():
        mine = (user >= 0) & ~claimed & (where[safe] == server)
        if mine.any():
            claimed |= mine
            _add_route(by_route, route_of_key(key), side[mine], got[mine])
    _add_route(by_route, "", side[~claimed], got[~claimed])


def _add_route(by_route: dict[str, list[int]], route: str, side: np.ndarray, got: np.ndarray) -> None:
    if got.any():
        sums = by_route.setdefault(route, [0, 0])
        for s in (0, 1):
            sums[s] += int(got[side == s].sum())
