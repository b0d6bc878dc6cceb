"""Sparse (witness, inbound) pairs for the verdict engine, and the index structures it keeps across evaluations.

The bounded probe plan (``reconciler.health.probing``) gives each witness a few dozen of the fleet's inbounds: at
N = 1,000 about 8% of the N × M mesh. The engine works on those pairs alone — arrays of length P, reduced with
``np.bincount`` — instead of scanning the mesh on every evaluation. Every ``Pairs`` is sorted by witness, then
inbound: the order ``np.nonzero`` gives over the mesh, so each order-dependent result (float32 sums, the order of
marks) is the one a scan of the mesh gives.

The pairs probed change only when the plan rotates, and the loop makes a new ``HealthEngine`` every tick, so what
is derived from them is kept per topology (``memo``), not per engine: the probe pattern last seen and its pairs,
and for the streak arrays the engine wrote, which of their entries are not -1. Those arrays are read-only once
written, so an array's identity says what it holds.
"""

from __future__ import annotations

import weakref
from functools import cached_property

import numpy as np

from reconciler.health.topology import Topology

_LIVE_KEPT = 2  # streak arrays remembered per topology: the loop's state's, and a copy's (``status`` evaluates one)


class Mesh:
    """The index arrays of a topology that pairs need. It holds no reference to the ``Topology``: a memo keyed
    weakly by the topology must not keep it alive."""

    def __init__(self, topology: Topology):
        self.n, self.m, self.countries = topology.n, topology.m, len(topology.country_codes)
        self.server_of = topology.server_of.astype(np.intp)
        self.country_idx = topology.country_idx.astype(np.intp)
        # One inbound per server: a (witness, inbound) pair is already a (witness, server) pair.
        self.one_inbound_per_server = np.unique(self.server_of).size == self.m


class Pairs:
    """(witness, inbound) pairs of one mesh, sorted by witness then inbound; ``flat`` = witness · M + inbound."""

    def __init__(self, mesh: Mesh, flat: np.ndarray, w: np.ndarray, t: np.ndarray):
        self.mesh = mesh
        self.flat, self.w, self.t = _frozen(flat), _frozen(w), _frozen(t)  # kept across evaluations: never edited

    @classmethod
    def from_flat(cls, mesh: Mesh, flat: np.ndarray) -> Pairs:
        flat = flat.astype(np.intp, copy=False)
        w = flat // max(mesh.m, 1)
        return cls(mesh, flat, w, flat - w * mesh.m)

    def __len__(self) -> int:
        return int(self.flat.size)

    def subset(self, keep: np.ndarray) -> Pairs:
        """The pairs where ``keep`` (by pair); this very object when it keeps all, so what it derived stays."""
        if keep.all():
            return self
        return Pairs(self.mesh, self.flat[keep], self.w[keep], self.t[keep])

    def of_witnesses(self, rows: np.ndarray) -> Pairs:
        """The pairs whose witness is in ``rows`` (N,) bool."""
        if rows.all():
            return self
        if not rows.any():
            return self.subset(np.zeros(len(self), dtype=bool))
        return self.subset(rows[self.w])

    def union(self, other: Pairs) -> Pairs:
        """The union with disjoint ``other``, still sorted: each pair's place is its own index plus the number of
        the other's pairs before it."""
        a, b = self, other
        at_a = np.searchsorted(b.flat, a.flat) + np.arange(len(a))
        at_b = np.searchsorted(a.flat, b.flat) + np.arange(len(b))
        out = []
        for x, y in ((a.flat, b.flat), (a.w, b.w), (a.t, b.t)):
            z = np.empty(len(a) + len(b), dtype=np.intp)
            z[at_a], z[at_b] = x, y
            out.append(z)
        return Pairs(self.mesh, *out)

    @cached_property
    def per_witness(self) -> np.ndarray:
        """(N,) int64: pairs by witness."""
        return _frozen(np.bincount(self.w, minlength=self.mesh.n))

    @cached_property
    def per_inbound(self) -> np.ndarray:
        """(M,) int64: pairs by inbound."""
        return _frozen(np.bincount(self.t, minlength=self.mesh.m))

    @cached_property
    def per_country_inbound(self) -> np.ndarray:
        """(countries, M) int64: pairs by the witness's country and the inbound."""
        mesh = self.mesh
        return _frozen(np.bincount(self.country_key, minlength=mesh.countries * mesh.m).reshape(mesh.countries, mesh.m))

    @cached_property
    def servers_per_witness(self) -> np.ndarray:
        """(N,) int64: distinct servers by witness (``by_server``)."""
        return _frozen(np.bincount(self.by_server[0], minlength=self.mesh.n))

    @cached_property
    def server(self) -> np.ndarray:
        """The server of each pair's inbound."""
        server: np.ndarray = self.mesh.server_of[self.t]
        return server

    @cached_property
    def own(self) -> np.ndarray:
        """The witness hosts the inbound."""
        own: np.ndarray = self.server == self.w
        return own

    @cached_property
    def country_key(self) -> np.ndarray:
        """country of the witness · M + inbound: the index into a (countries, M) array, flattened."""
        key: np.ndarray = self.mesh.country_idx[self.w] * self.mesh.m + self.t
        return key

    @cached_property
    def by_server(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The distinct (witness, server) pairs, as witness and server arrays, and each pair's index into them."""
        n = self.mesh.n
        if self.mesh.one_inbound_per_server:
            return self.w, self.server, np.arange(len(self), dtype=np.intp)
        keys, index = np.unique(self.w * n + self.server, return_inverse=True)  # sorted: by witness, then server
        return keys // n, keys % n, index.astype(np.intp)


def _frozen(a: np.ndarray) -> np.ndarray:
    """``a``, read-only: what pairs hold and derive is shared by every evaluation that meets them again."""
    a.flags.writeable = False
    return a


class Memo:
    """What the engine derives from one topology's probe patterns and streak arrays, kept across evaluations."""

    def __init__(self, topology: Topology):
        self.mesh = Mesh(topology)
        # The last ``probe_present`` seen (a copy) and its pairs, one tuple: swapped whole, never seen half-made.
        self._present: tuple[np.ndarray, Pairs] | None = None
        self._live: list[tuple[weakref.ref[np.ndarray], Pairs]] = []

    def present(self, probe_present: np.ndarray) -> Pairs:
        """The pairs ``probe_present`` holds, a witness's own inbounds left out. One scan of the mesh when the
        pattern changed; one comparison when it did not."""
        seen = self._present
        if seen is not None and np.array_equal(seen[0], probe_present):
            return seen[1]
        pairs = Pairs.from_flat(self.mesh, np.flatnonzero(probe_present))
        pairs = pairs.subset(~pairs.own)
        self._present = (np.array(probe_present, dtype=bool), pairs)
        return pairs

    def live(self, fail: np.ndarray) -> Pairs:
        """The entries of the streak array ``fail`` that are not -1 (remembered for the arrays the engine wrote;
        a scan of the mesh for any other, such as a state just loaded)."""
        for ref, pairs in self._live:
            if ref() is fail:
                return pairs
        return Pairs.from_flat(self.mesh, np.flatnonzero(np.asarray(fail) != -1))

    def wrote(self, fail: np.ndarray, live: Pairs) -> None:
        """``fail`` was written by the engine, and ``live`` are its entries that are not -1. It is made read-only:
        its identity must go on saying what it holds."""
        fail.flags.writeable = False
        kept = [(ref, pairs) for ref, pairs in self._live if ref() is not None]
        self._live = [(weakref.ref(fail), live), *kept[:_LIVE_KEPT - 1]]


_MEMOS: weakref.WeakKeyDictionary[Topology, Memo] = weakref.WeakKeyDictionary()


def memo(topology: Topology) -> Memo:
    """The topology's memo (equal topologies share one: what it holds depends on the topology's fields alone)."""
    found = _MEMOS.get(topology)
    if found is None:
        found = _MEMOS[topology] = Memo(topology)
    return found
