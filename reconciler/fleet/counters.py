"""The servers' kernel counters, read (pure): one cumulative counter per (user mark, IP version, transport) and
direction, as arrays.

``read_counters`` makes a report's counters a ``CounterTable`` (one sorted key per counter, the owner its mark had,
packets and bytes) and finds each row's user by a sorted search of the marks (``UserIndex``), reusing the last
report's match when the keys are the same (``RowOrder``). ``counted`` gives the payload bytes each row adds since
the last read: growth under the same owner, headers taken off, a counter that went back or changed hands a new
baseline. What the bytes count for is ``fleet.usage``'s to decide (``Ledger.fold``).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np

from reconciler.balance.hashing import key64, name_keys
from reconciler.engine.base import user_marks
from reconciler.fleet.reports import KIND_OF, KINDS, UsageCounters

# Bytes of headers per counted packet: IPv4 20 / IPv6 40, plus TCP 20 with the timestamp option Linux uses (12),
# or UDP 8. Other transports (ICMP errors about a user's connection) carry no payload of the user's.
HEADER_BYTES = {("ipv4", "tcp"): 52, ("ipv6", "tcp"): 72, ("ipv4", "udp"): 28, ("ipv6", "udp"): 48}


HEADERS = np.array([-1] + [HEADER_BYTES[k] for k in KINDS[1:] if k is not None], dtype=np.int64)  # by kind


SIDE_SHIFT, KIND_SHIFT = 35, 32  # a counter's key: side (0 tx, 1 rx) << 35 | kind << 32 | mark
# Bytes or packets one counter can add in one interval (a terabyte: 133 Gbit/s for a minute); more is a broken or
# hostile counter, counted as this at most. So sums of a report's rows (at most 2**21) stay far inside 64 bits.
DELTA_CAP = 1 << 40


def owner_id(name: str) -> int:
    """A user's identity in the counters: the balancer's key of the name, in 63 bits (int64), never 0 (nobody's)."""
    return (key64(name) >> 1) or 1


@dataclass(frozen=True)
class UserIndex:
    """One cluster's users as arrays (built once per set of names): who owns which mark."""

    names: tuple[str, ...]  # the cluster's order
    sorted_marks: np.ndarray  # int64, ascending
    mark_user: np.ndarray  # int64: the index (into names) of each sorted mark's user
    owners: np.ndarray  # int64: owner_id per user (names' order)


@functools.lru_cache(maxsize=4)
def user_index(names: tuple[str, ...], key: bytes) -> UserIndex:
    marks = user_marks(names, key)  # not marks_for's cache: the loop keeps only these arrays (a million-entry dict less)
    by_user = np.fromiter((marks[n] for n in names), np.int64, len(names))
    order = np.argsort(by_user, kind="stable")
    owners = (name_keys(names) >> np.uint64(1)).astype(np.int64)
    return UserIndex(names, by_user[order], order.astype(np.int64), np.where(owners == 0, 1, owners))


@dataclass(frozen=True)
class CounterTable:
    """One server's counters when last read, sorted by key (side << 35 | kind << 32 | mark), with the owner each
    mark had then (``owner_id``; 0: nobody), cumulative packets and bytes."""

    keys: np.ndarray
    owners: np.ndarray
    packets: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def empty(cls) -> CounterTable:
        z = np.zeros(0, np.int64)
        return cls(z, z, z, z)

    def with_owners(self, owner: int) -> CounterTable:
        """The same counters as if every mark had belonged to ``owner`` (tests: a mark that changed hands)."""
        return CounterTable(self.keys, np.full(len(self.keys), owner, np.int64), self.packets, self.nbytes)


@dataclass(frozen=True)
class RowOrder:
    """How one server's last report became its table: which of its rows were kept, in key order, and whose each
    is. A server reports the same rows in the same order interval after interval (its users' counters), so the next
    report with the same keys, under the same users, is matched without sorting or a search in a million marks
    (that search was a fifth of a million users' interval). Kept in memory only, never trusted across reports:
    the keys' digest must match, and the index be the same object."""

    index: UserIndex
    digest: bytes  # blake2b of the report's keys, in its own order
    order: np.ndarray  # int32: the kept rows' positions in the report, in key order
    user: np.ndarray  # int32: each kept row's user (-1: nobody's)
    keys: np.ndarray  # the table's keys and owners (shared with the table made from them: no copy)
    owners: np.ndarray


def read_counters(usage: UsageCounters, index: UserIndex,
                  known: RowOrder | None = None) -> tuple[CounterTable, np.ndarray, RowOrder | None]:
    """A report's counters as a table (one row per key: a key reported twice keeps its last row), the index of
    each row's user (-1: a mark nobody owns), and how they were matched (``known``: the last report's, reused
    when this one has the same keys in the same order)."""
    tx, rx = usage.tx, usage.rx
    n = len(tx) + len(rx)
    if not n:
        return CounterTable.empty(), np.zeros(0, np.int64), None
    side = np.zeros(n, np.int64)
    side[len(tx):] = 1
    raw = (side << SIDE_SHIFT) | (np.concatenate([tx.kinds, rx.kinds]) << KIND_SHIFT) | np.concatenate([tx.marks, rx.marks])
    digest = hashlib.blake2b(raw.tobytes(), digest_size=16).digest()
    packets, nbytes = np.concatenate([tx.packets, rx.packets]), np.concatenate([tx.nbytes, rx.nbytes])
    if known is not None and known.index is index and known.digest == digest:
        order = known.order
        return (CounterTable(known.keys, known.owners, packets[order], nbytes[order]), known.user.astype(np.int64),
                known)
    order = np.argsort(raw, kind="stable")
    keys = raw[order]
    last = np.ones(n, bool)
    last[:-1] = keys[1:] != keys[:-1]
    order, keys = order[last], keys[last]
    user = np.full(len(keys), -1, np.int64)
    owners = np.zeros(len(keys), np.int64)
    if len(index.names):
        mark = keys & 0xFFFFFFFF
        at = np.minimum(np.searchsorted(index.sorted_marks, mark), len(index.names) - 1)
        found = index.sorted_marks[at] == mark
        user[found] = index.mark_user[at[found]]
        owners[found] = index.owners[user[found]]
    return (CounterTable(keys, owners, packets[order], nbytes[order]), user,
            RowOrder(index, digest, order.astype(np.int32), user.astype(np.int32), keys, owners))


def counted(before: CounterTable | None, after: CounterTable, user: np.ndarray, cap: int = DELTA_CAP) -> np.ndarray:
    """The payload bytes each row of ``after`` adds since ``before`` (None: a first contact, a baseline: nothing).

    A key seen before under the same owner adds its growth (a counter that went back is a new baseline: nothing);
    a new key adds all it holds (the kernel made it since the last read); a key whose mark changed hands, or
    nobody's, adds nothing. No row adds more than ``cap`` bytes or packets."""
    if before is None or not len(after):
        return np.zeros(len(after), np.int64)
    packets, nbytes = after.packets, after.nbytes
    if len(before) and (before.keys is after.keys or (len(before) == len(after)
                                                      and np.array_equal(before.keys, after.keys))):
        same = before.owners == after.owners  # the same keys as last time (the common case): row for row
        dp, db = packets - before.packets, nbytes - before.nbytes
        grew = same & (dp >= 0) & (db >= 0)
        packets, nbytes = np.where(grew, dp, 0), np.where(grew, db, 0)
        mine = (user >= 0) & same
    elif len(before):
        at = np.searchsorted(before.keys, after.keys)
        atc = np.minimum(at, len(before) - 1)
        found = (at < len(before)) & (before.keys[atc] == after.keys)
        same = found & (before.owners[atc] == after.owners)
        dp, db = packets - before.packets[atc], nbytes - before.nbytes[atc]
        grew = same & (dp >= 0) & (db >= 0)
        packets, nbytes = np.where(grew, dp, np.where(found, 0, packets)), np.where(grew, db, np.where(found, 0, nbytes))
        mine = (user >= 0) & (~found | same)
    else:
        mine = user >= 0
    header = HEADERS[(after.keys >> KIND_SHIFT) & 0x7]
    got = np.minimum(nbytes, cap) - header * np.minimum(packets, cap)
    return np.where(mine & (header >= 0) & (got > 0), got, 0)


def old_key(text: str) -> int:
    """A counter's key as state format 1 wrote it (``side:mark:family:transport``), as an integer key."""
    side, mark, family, transport = text.split(":", 3)
    return (int(side) << SIDE_SHIFT) | (KIND_OF.get((family, transport), 0) << KIND_SHIFT) | (int(mark) & 0xFFFFFFFF)
