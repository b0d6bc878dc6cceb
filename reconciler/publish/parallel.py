"""A big pass in worker processes: the snapshot pickled into an anonymous file in memory that the workers inherit as
they start (``Spill``: never with the secret), the users handed out as they are taken, from both ends of one list.

The pass's users are ordered by what they are assigned (users with the same entries share a document template, and a
snapshot keeps a bounded number of templates, see ``subscriptions.document.TEMPLATES_KEPT``). The calling process takes
blocks of them from the front and the workers from the back, through a cursor they share (``Ends``), until the two
ends meet: nobody waits for a slice cut in advance (a worker starts a second or more after the pass), and each process
renders the templates of its own end of the list.
"""

from __future__ import annotations

import copy
import gc
import mmap
import os
import pickle
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing import reduction
from multiprocessing.context import get_spawning_popen
from typing import Any, overload

import numpy as np

from reconciler.balance import Snapshot
from reconciler.credentials import Secret
from reconciler.model import User
from reconciler.publish.manifest import PublishedTable, empty_columns
from reconciler.publish.userfiles import Before, Part, has_shadowsocks, write_users

#: Earlier versions spilled a pass's snapshot to a file of this prefix in the state folder (HMAC'd, since a file with a
#: name there could be swapped): one a killed pass left is removed at start-up (``FileOutlet.clean_temporaries``).
SPILL_PREFIX = ".outlet-snapshot."
BLOCK = 512  # users taken at a time (~30 ms of work): the two ends meet within one block of each other


class Spill:
    """A pass's snapshot as its workers read it: an anonymous file in memory (``memfd``), made before the workers start,
    which each inherits as it starts (its descriptor goes along with the pool's initializer, ``start_worker``). Nothing
    in any folder: no file another process could swap in under its name (the workers unpickle what they read), nothing
    written to the disk (~100 MB a pass at a million users), nothing a killed pass leaves behind. Before, a file in the
    state folder, HMAC'd under a key from the master secret and checked by each worker: ~25 ms of hashing on either
    side of a 100k-user pass."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd = os.memfd_create("reconciler-outlet-pass", os.MFD_CLOEXEC) if fd is None else fd
        self.size = 0

    def dump(self, value: object) -> None:
        """``value`` pickled into the file (once, before the workers are called)."""
        with open(self.fd, "wb", closefd=False) as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
            self.size = f.tell()

    def load(self, size: int) -> Any:
        """In a worker: what ``dump`` pickled (``size`` bytes), read where it lies in memory (no copy of the bytes)."""
        with mmap.mmap(self.fd, size, prot=mmap.PROT_READ) as data:
            return pickle.loads(data)

    def close(self) -> None:
        os.close(self.fd)

    def __reduce__(self) -> tuple[Any, ...]:
        if get_spawning_popen() is None:  # (a descriptor goes to a process as it is started, never anywhere else)
            raise TypeError("a pass's spill goes to its workers as they start, with the pool's initializer")
        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(fd: Any) -> Spill:
    """In a worker: the pass's spill, on the descriptor ``Spill.__reduce__`` sent."""
    return Spill(fd.detach())


class Ends:
    """The users of a pass not taken yet, ``[lo, hi)`` in the pass's order, shared by its processes: the calling one
    takes blocks from the front, the workers from the back. ``shared``: a ``multiprocessing`` array of two 64-bit
    integers with its lock (``context.Array("q", [0, n])``), handed to the workers as they start."""

    WAIT = 30.0  # seconds: a lock held longer was held by a process that died holding it (the pass fails, said so)

    def __init__(self, shared: Any) -> None:
        self.shared = shared
        self._lock, self._ends = shared.get_lock(), shared.get_obj()

    @contextmanager
    def _held(self) -> Iterator[Any]:
        if not self._lock.acquire(timeout=self.WAIT):
            raise RuntimeError("the users of this pass could not be handed out: a worker process held their lock")
        try:
            yield self._ends
        finally:
            self._lock.release()

    def take(self, front: bool) -> tuple[int, int] | None:
        with self._held() as ends:
            lo, hi = ends[0], ends[1]
            if lo >= hi:
                return None
            if front:
                ends[0] = end = min(hi, lo + BLOCK)
                return lo, end
            ends[1] = start = max(lo, hi - BLOCK)
            return start, hi

    def blocks(self, front: bool) -> Iterator[tuple[int, int]]:
        while (got := self.take(front)) is not None:
            yield got

    def left(self) -> int:
        with self._held() as ends:
            return max(0, int(ends[1] - ends[0]))

    def close(self) -> None:
        """Nothing more is taken (this pass failed here: the workers stop after the block they hold)."""
        with self._held() as ends:
            ends[0] = ends[1]


class ColumnUsers(Sequence[User]):
    """A pass's users as they go to its workers: each field a column (a list), each user made back as a worker
    takes it. Pickled as models, 100k users were 0.23 s to write and 0.3 s to read before a worker could start
    (3 µs a user: each model's state a dict of its own); as columns, ~0.03 s each, and a worker makes only the users
    it takes (~1.7 µs each). A user is made once: asked again, the same object (``Snapshot.standing`` asks ``is``)."""

    def __init__(self, fields: tuple[str, ...], columns: tuple[list[Any], ...], given: list[Any]) -> None:
        self._fields, self._columns, self._given = fields, columns, given
        self._made: list[User | None] = [None] * len(given)

    @classmethod
    def of(cls, users: Sequence[User]) -> ColumnUsers:
        fields = tuple(User.model_fields)
        states = [u.__dict__ for u in users]  # (each user's attribute looked up once, not once a field: 22 ms, not 35)
        return cls(fields, tuple([d[f] for d in states] for f in fields),
                   [u.__pydantic_fields_set__ for u in users])  # (a few sets shared by all: ``User``'s validator)

    def __reduce__(self) -> tuple[Any, ...]:
        return ColumnUsers, (self._fields, self._columns, self._given)

    def __len__(self) -> int:
        return len(self._given)

    @overload
    def __getitem__(self, i: int) -> User: ...

    @overload
    def __getitem__(self, i: slice) -> list[User]: ...

    def __getitem__(self, i: int | slice) -> User | list[User]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        made = self._made[i]
        if made is None:  # what pydantic's way back from a pickle (``__setstate__``) sets, set directly
            made = _new_user(User)
            _set(made, "__dict__", dict(zip(self._fields, [col[i] for col in self._columns], strict=True)))
            _set(made, "__pydantic_fields_set__", self._given[i])
            _set(made, "__pydantic_extra__", None)
            _set(made, "__pydantic_private__", None)
            self._made[i] = made
        return made


_new_user, _set = User.__new__, object.__setattr__


def spilled(snapshot: Snapshot) -> Snapshot:
    """The snapshot as a pass's workers get it: the same, with its cluster's users as columns (``ColumnUsers``).
    Shallow copies: what the snapshot and its cluster computed once (the roster, the standings) goes along. Only
    for ``write_users``: a cluster whose users are columns is no model to dump or compare (``cluster_digest``
    would fail on it), and is never handed anywhere else."""
    cluster = snapshot.cluster.model_copy()
    cluster.__dict__["users"] = ColumnUsers.of(snapshot.cluster.users)
    out = copy.copy(snapshot)
    # The users' balancing keys (a cached property) go along: this process has them (the balancer asked for them), a
    # worker would hash every user's name again (~30 ms at 100k users).
    out.__dict__["user_key_array"] = snapshot.user_key_array
    object.__setattr__(out, "cluster", cluster)
    return out


_ends: Ends | None = None  # in a worker process: the cursor of the pass its pool serves (``start_worker``)
_spill: list[Spill] = []  # in a worker process: its pass's ``Spill``
_kept: list[Snapshot] = []  # in a worker process: the snapshot of its last call (``write_in_worker``)


def start_worker(shared: Any, spill: Spill) -> None:
    """A worker process's start (the pool's initializer): the pass's cursor and its spill, inherited as the process
    starts. A worker lives for one pass and ends with ``os._exit``: its cyclic collector is off for good. (Back on after
    the pass, its first collection walked the unpickled snapshot once more before the worker could answer: ~25 ms at
    100k users, the calling process waiting.)"""
    global _ends
    gc.disable()
    _ends = Ends(shared)
    _spill[:] = [spill]


def write_in_worker(size: int, secret: Secret, directory: str, formats: tuple[str, ...], unseen: bool = False) -> Part:
    """The users this worker takes from the back of the pass's list until the ends meet (nothing when the calling
    process took them all before this worker started), from the ``size`` bytes of the pass's spill. ``unseen``: as
    ``write_users``'."""
    assert _ends is not None and _spill, "a worker of a pass's pool (start_worker)"
    if not _ends.left():  # taken by the calling process meanwhile: no snapshot to unpickle
        return Part(np.zeros(0, np.int64), *empty_columns(0), 0, 0)
    # (The collector is off in a worker, ``start_worker``: millions of long-lived objects are unpickled here.)
    snapshot, which, headers_only, before = _spill[0].load(size)
    # Kept past this call: freed as the call returned, the snapshot's objects one by one held its answer back (and
    # the calling process waiting for it) ~50 ms at 100k users; a pool's worker ends with ``os._exit``.
    _kept[:] = [snapshot]
    # (None: nobody was published before, a first pass; 11 MB of zeros at 100k users not pickled)
    return write_users(snapshot, secret, directory, formats, before or empty_columns(len(which)), which, headers_only,
                       has_shadowsocks(snapshot), _ends.blocks(front=False), unseen, backward=True)


def published_before(table: PublishedTable, which: np.ndarray) -> Before:
    return table.tokens[which], table.prints[which], table.sizes[which]


def locality_order(columns: list[np.ndarray], which: np.ndarray) -> np.ndarray:
    """An order of ``which`` (positions) that keeps users with the same assignments (one column of inbounds per route
    key) together: their documents share templates."""
    if not columns or not len(which):
        return np.arange(len(which))
    return np.lexsort([col[which] for col in reversed(columns)])
