"""Who witnesses whom: the mesh the verdict engine judges (HEALTH-5..9).

Servers are witnesses (N), inbounds are targets (M). A ``Topology`` is built
once per cluster file (``from_cluster``) and carries the derived index arrays
the vectorised engine and the verdicts' reasons both read. Pure; imports only
the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from reconciler.model import Cluster
from reconciler.model.regions import COUNTRY_REGION


@dataclass(frozen=True)
class Topology:
    """Servers (witnesses), inbounds (targets), countries and probers, with derived arrays.

    The derived fields are computed once in ``__post_init__`` from the declared ones; they are not
    arguments, not compared and not shown.
    """

    servers: tuple[str, ...]
    countries: tuple[str, ...]  # per server
    probers: tuple[bool, ...]  # per server
    inbounds: tuple[str, ...]  # target ids
    inbound_server: tuple[int, ...]  # per inbound: index into servers
    regions: tuple[str, ...] = ()  # per server, the steering region (STEER-4); empty: derived from the countries

    server_of: npt.NDArray[np.int32] = field(init=False, compare=False, repr=False)  # (M,) inbound → server
    own: npt.NDArray[np.bool_] = field(init=False, compare=False, repr=False)  # (N, M) server w hosts inbound t
    country_codes: tuple[str, ...] = field(init=False, compare=False, repr=False)  # sorted distinct countries
    country_idx: npt.NDArray[np.int32] = field(init=False, compare=False, repr=False)  # (N,) index into country_codes
    country_order: npt.NDArray[np.intp] = field(init=False, compare=False, repr=False)  # servers grouped by country
    country_starts: npt.NDArray[np.intp] = field(init=False, compare=False, repr=False)  # group starts in that order
    prober_mask: npt.NDArray[np.bool_] = field(init=False, compare=False, repr=False)  # (N,)
    prober_target: npt.NDArray[np.bool_] = field(init=False, compare=False, repr=False)  # (M,) inbound of a prober
    lgamma: npt.NDArray[np.float64] = field(init=False, compare=False, repr=False)  # lgamma(x) for x in 0..N+2
    same_country: npt.NDArray[np.bool_] = field(init=False, compare=False, repr=False)  # (N, N) w and s share a country
    country_region: tuple[str, ...] = field(init=False, compare=False, repr=False)  # per country code: its region
    _inbound_order: npt.NDArray[np.intp] = field(init=False, compare=False, repr=False)  # inbounds grouped by server
    _group_starts: npt.NDArray[np.intp] = field(init=False, compare=False, repr=False)  # group starts in that order
    _grouped: npt.NDArray[np.intp] = field(init=False, compare=False, repr=False)  # the server of each group

    def __post_init__(self) -> None:
        n, m = len(self.servers), len(self.inbounds)
        if not (len(self.countries) == len(self.probers) == n and len(self.inbound_server) == m):
            raise ValueError("topology arrays disagree in length")
        if self.regions and len(self.regions) != n:
            raise ValueError("topology arrays disagree in length")
        regions = self.regions or tuple(COUNTRY_REGION.get(c.upper(), "") for c in self.countries)
        server_of = np.asarray(self.inbound_server, dtype=np.int32)
        own = np.zeros((n, m), dtype=bool)
        own[server_of, np.arange(m)] = True
        codes = sorted(set(self.countries))
        country_idx = np.array([codes.index(c) for c in self.countries], dtype=np.int32)
        order = np.argsort(country_idx, kind="stable")
        starts = np.flatnonzero(np.r_[True, np.diff(country_idx[order]) != 0]) if n else np.array([], dtype=np.intp)
        prober_mask = np.asarray(self.probers, dtype=bool)
        inbound_order = np.argsort(server_of, kind="stable")
        grouped_sorted = server_of[inbound_order]
        group_starts = np.flatnonzero(np.r_[True, np.diff(grouped_sorted) != 0]) if m else np.zeros(0, np.intp)
        # A country's region: its first server's (an operator may set a server's region by hand).
        country_region = tuple(next(regions[i] for i in range(n) if self.countries[i] == code) for code in codes)
        # A frozen dataclass sets its own derived fields through object.__setattr__, once, here.
        derived: dict[str, object] = {
            "server_of": server_of, "own": own, "country_codes": tuple(codes), "country_idx": country_idx,
            "country_order": order, "country_starts": starts, "prober_mask": prober_mask,
            "prober_target": prober_mask[server_of] if m else np.zeros(0, dtype=bool),
            "lgamma": np.array([math.lgamma(x) if x > 0 else np.inf for x in range(n + 3)]),
            "same_country": country_idx[:, None] == country_idx[None, :], "country_region": country_region,
            "_inbound_order": inbound_order, "_group_starts": group_starts,
            "_grouped": grouped_sorted[group_starts] if m else np.zeros(0, np.intp),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def n(self) -> int:
        return len(self.servers)

    @property
    def m(self) -> int:
        return len(self.inbounds)

    def any_per_server(self, a: np.ndarray) -> npt.NDArray[np.bool_]:
        """(N, M) bool per witness and inbound → (N, N): true where any of the server's inbounds is."""
        if self._group_starts.size == self.m:  # one inbound per server: no sum to take
            out = np.zeros((a.shape[0], self.n), dtype=bool)
            out[:, self._grouped] = a[:, self._inbound_order]
            return out
        found: npt.NDArray[np.bool_] = self.per_server(a) > 0
        return found

    def per_server(self, a: np.ndarray) -> npt.NDArray[np.int32]:
        """(N, M) per witness and inbound → (N, N) per witness and server: the sum over each server's inbounds."""
        out = np.zeros((a.shape[0], self.n), dtype=np.int32)
        if not self.m:
            return out
        if self._group_starts.size == self.m:  # one inbound per server: a column for a column
            out[:, self._grouped] = a[:, self._inbound_order]
        else:  # summed along rows of the transpose (contiguous), ~30x faster than reduceat across columns
            rows = a.T[self._inbound_order].astype(np.int32)
            out[:, self._grouped] = np.add.reduceat(rows, self._group_starts, axis=0).T
        return out

    @classmethod
    def from_cluster(cls, cluster: Cluster) -> Topology:
        index = {s.name: i for i, s in enumerate(cluster.servers)}
        refs = cluster.inbounds
        return cls(
            servers=tuple(s.name for s in cluster.servers),
            countries=tuple(s.country for s in cluster.servers),
            probers=tuple(bool(s.prober) for s in cluster.servers),
            inbounds=tuple(r.inbound.id for r in refs),
            inbound_server=tuple(index[r.server.name] for r in refs),
            regions=tuple(s.region or "" for s in cluster.servers),
        )
