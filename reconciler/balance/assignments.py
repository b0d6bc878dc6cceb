"""Which inbound each user holds on each route, as columns (LB-6: what the next batch starts from).

A million users on a few routes are millions of (user, route) pairs; a dict of them cost hundreds of megabytes
and a second to build, copy, count or hash. ``Assignments`` keeps, per route key (a route id, or ``pool_key``'s
place in one pool), one array over the users (in a cluster's order) of the inbound each holds: an index into
``inbounds``, -1 for none. It reads as the mapping (user, route key) → inbound id it stands for, so a request, a
test or a command asks it as before; the batch, the counts, the outlets' digest and the state read the arrays.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, Mapping
from functools import cached_property

import numpy as np

NONE = -1


class Assignments(Mapping[tuple[str, str], str]):
    """Immutable: (user, route key) → inbound id, one int32 column per route key over ``names``."""

    def __init__(self, names: tuple[str, ...], inbounds: tuple[str, ...], columns: Mapping[str, np.ndarray],
                 position: Mapping[str, int] | None = None) -> None:
        self.names, self.inbounds = names, inbounds
        self.columns = dict(columns)
        for col in self.columns.values():
            if col.shape != (len(names),) or (len(col) and (col.min() < NONE or col.max() >= len(inbounds))):
                raise ValueError("an assignment column does not fit its users or inbounds")
            col.flags.writeable = False
        self._position = position

    @classmethod
    def of(cls, pairs: Mapping[tuple[str, str], str], names: tuple[str, ...], inbounds: tuple[str, ...],
           position: Mapping[str, int] | None = None) -> Assignments:
        """Any mapping of (user, route key) → inbound id, over ``names`` and ``inbounds`` (pairs of other users or
        inbounds are left out)."""
        if isinstance(pairs, Assignments):
            return pairs.realigned(names, inbounds, position)
        at = position if position is not None else {n: i for i, n in enumerate(names)}
        inbound_at = {t: i for i, t in enumerate(inbounds)}
        columns: dict[str, np.ndarray] = {}
        for (user, key), inbound in pairs.items():
            i, t = at.get(user), inbound_at.get(inbound)
            if i is None or t is None:
                continue
            col = columns.get(key)
            if col is None:
                col = columns[key] = np.full(len(names), NONE, np.int32)
            col[i] = t
        return cls(names, inbounds, columns, position)

    def realigned(self, names: tuple[str, ...], inbounds: tuple[str, ...],
                  position: Mapping[str, int] | None = None) -> Assignments:
        """The same assignments over other users and inbounds (a changed file): users and inbounds that left are
        gone, new users hold nothing yet."""
        same_names = names is self.names or names == self.names
        if same_names and (inbounds is self.inbounds or inbounds == self.inbounds):
            return self if position is None or self._position is position else \
                Assignments(names, inbounds, self.columns, position)
        inbound_at = {t: i for i, t in enumerate(inbounds)}
        to_new = np.array([inbound_at.get(t, NONE) for t in self.inbounds] + [NONE], np.int32)  # [-1] → NONE
        if same_names:
            return Assignments(names, inbounds, {k: to_new[c] for k, c in self.columns.items()}, position)
        at = self._at
        src = np.fromiter((at.get(n, -1) for n in names), np.int64, len(names))
        have = src >= 0
        columns = {}
        for key, col in self.columns.items():
            new = np.full(len(names), NONE, np.int32)
            new[have] = to_new[col[src[have]]]
            columns[key] = new
        return Assignments(names, inbounds, columns, position)

    @cached_property
    def _at(self) -> Mapping[str, int]:
        return self._position if self._position is not None else {n: i for i, n in enumerate(self.names)}

    def column(self, key: str) -> np.ndarray | None:
        """The route key's column (read only), None when nobody holds anything on it."""
        return self.columns.get(key)

    def counts(self) -> dict[tuple[str, str], int]:
        """(route key, inbound id) → how many users hold it."""
        out: dict[tuple[str, str], int] = {}
        for key, col in self.columns.items():
            held = np.bincount(col[col >= 0], minlength=len(self.inbounds))
            out.update({(key, self.inbounds[t]): int(held[t]) for t in np.flatnonzero(held).tolist()})
        return out

    def __getitem__(self, pair: tuple[str, str]) -> str:
        user, key = pair
        col = self.columns.get(key)
        i = self._at.get(user)
        if col is None or i is None or col[i] < 0:
            raise KeyError(pair)
        return self.inbounds[int(col[i])]

    def __contains__(self, pair: object) -> bool:
        try:
            self[pair]  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            return False
        return True

    def __iter__(self) -> Iterator[tuple[str, str]]:
        names = self.names
        for key, col in self.columns.items():
            for i in np.flatnonzero(col >= 0).tolist():
                yield names[i], key

    def items(self) -> ItemsView[tuple[str, str], str]:
        return _Items(self)

    def __len__(self) -> int:
        return self._len

    @cached_property
    def _len(self) -> int:
        return sum(int((c >= 0).sum()) for c in self.columns.values())

    def __repr__(self) -> str:
        return f"Assignments({len(self)} over {len(self.names)} users and {len(self.columns)} route keys)"


class _Items(ItemsView[tuple[str, str], str]):
    """The pairs read column by column (not one lookup per pair)."""

    _mapping: Assignments

    def __iter__(self) -> Iterator[tuple[tuple[str, str], str]]:
        a = self._mapping
        names, inbounds = a.names, a.inbounds
        for key, col in a.columns.items():
            held = np.flatnonzero(col >= 0)
            for i, t in zip(held.tolist(), col[held].tolist(), strict=True):
                yield (names[i], key), inbounds[t]
