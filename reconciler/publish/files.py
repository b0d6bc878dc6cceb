"""The file outlet: every user's subscription files, written again only where their inputs changed, the manifest
after them, and the checks at start-up that repair what a crash or a full disk left."""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reconciler import gcpause
from reconciler.balance import Snapshot
from reconciler.balance.assignments import Assignments
from reconciler.credentials import Secret, is_token
from reconciler.model import Cluster
from reconciler.model.roster import ACTIVE
from reconciler.publish.digests import cluster_digest, snapshot_digest, usage_steps
from reconciler.publish.manifest import MANIFEST, MAX_MANIFEST_BYTES, Published, PublishedTable, is_fingerprint
from reconciler.publish.parallel import (
    SPILL_PREFIX,
    Ends,
    Spill,
    locality_order,
    published_before,
    spilled,
    start_worker,
    write_in_worker,
)
from reconciler.publish.userfiles import DIR_MODE, STRETCH, Part, WriteStats, file_names, has_shadowsocks, write_users
from reconciler.safe_read import read_regular_file
from reconciler.state.files import write_atomic
from reconciler.subscriptions import FORMATS

#: Raised when the same inputs give other files (the snapshot digest holds it: a pass after an upgrade compares every
#: user). 2: ETags of documents made from templates are the template's tag and the user's (``Prepared.etag``).
DOCUMENTS = 2
_TREE = re.compile(r"\.\d+-[0-9a-f]{8}\.tmp")  # what ``FileOutlet._tree`` adds to the folder's name


@dataclass(frozen=True)
class _Basis:
    """What one pass wrote the users' files from: what every document shares, and per user (in the file's order)
    the inputs of its fingerprint that change between intervals — its standing, its usage step, its inbounds."""

    shared: str
    names: tuple[str, ...]
    codes: np.ndarray
    steps: np.ndarray
    held: Assignments

    @classmethod
    def of(cls, snapshot: Snapshot, cluster_hash: str) -> _Basis:
        roster = snapshot.cluster.roster
        h = hashlib.sha256(cluster_hash.encode())
        h.update(json.dumps([snapshot.public_keys, snapshot.tls_pins], sort_keys=True).encode())
        return cls(h.hexdigest(), roster.names, snapshot.standings,
                   usage_steps(roster.data_limit, roster.measured(snapshot.usage)[0]), snapshot.held)

    def changed(self, before: _Basis | None) -> tuple[np.ndarray, np.ndarray] | None:
        """The users (positions) whose documents may differ from ``before``'s, and for each whether only its
        usage step moved while it is served (then only its headers can differ: the bodies hold no usage); None:
        anyone's documents may differ (compare all)."""
        if (before is None or before.shared != self.shared
                or (before.names is not self.names and before.names != self.names)
                or before.held.inbounds != self.held.inbounds
                or before.held.columns.keys() != self.held.columns.keys()):
            return None
        moved = self.codes != before.codes
        for key, col in self.held.columns.items():
            moved |= col != before.held.columns[key]
        which = np.flatnonzero(moved | (self.steps != before.steps))
        return which, ~moved[which] & (self.codes[which] == ACTIVE)


class FileOutlet:
    """Subscription files for every user; a big (re)write is split across worker processes."""

    PARALLEL_MIN = 20_000  # users to look at before worker processes pay for their start (~1 s)
    MANIFEST_EVERY = 300.0  # seconds: a pass over only the changed users records the manifest at most this often
    SWEEP = 64  # each pass over the changed users also checks that 1/SWEEP of all users' folders are still there

    def __init__(self, directory: Path, state_dir: Path, secret: Secret, formats: Iterable[str] = FORMATS,
                 workers: int | None = None):
        self.directory = directory
        self.manifest_path = state_dir / MANIFEST
        self.secret = secret
        self.formats = tuple(formats)
        self.workers = workers if workers is not None else min(8, os.cpu_count() or 1)
        self._cluster_hash: tuple[int, str] | None = None
        self._basis: _Basis | None = None  # what the files were last written from (which users changed since)
        self._manifest_at = self._written_at = 0.0
        self._sweep = 0  # where the next pass's check of folders starts
        self.notes: list[str] = []  # what could not be read, for the caller to log
        self.digest, self.published = self._read_manifest()

    def _read_manifest(self) -> tuple[str, PublishedTable]:
        """(snapshot digest, user → what was published); entries that are not well-formed are dropped
        (their users are written again), a manifest that cannot be read is a fresh start, noted."""
        try:
            data = json.loads(read_regular_file(str(self.manifest_path), MAX_MANIFEST_BYTES))  # no FIFO, no 10 GB file
        except FileNotFoundError:
            return "", PublishedTable((), {})
        except OSError as exc:  # not a regular file, or too big: said in full
            why = exc.strerror or type(exc).__name__
            self.notes.append(f"ignoring {self.manifest_path}: {'it ' if why.startswith('is ') else ''}{why}; every "
                              "user's files are written again (and the manifest with them)")
            return "", PublishedTable((), {})
        except (ValueError, RecursionError) as exc:
            self.notes.append(f"ignoring unreadable {self.manifest_path} ({type(exc).__name__}); every user's files are "
                              "written again")
            return "", PublishedTable((), {})
        users = data.get("users") if isinstance(data, dict) else None
        if not isinstance(users, dict):
            self.notes.append(f"ignoring {self.manifest_path}: not a manifest; every user's files are written again")
            return "", PublishedTable((), {})
        out: dict[str, Published] = {}
        for name, entry in users.items():
            if (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and is_token(entry[0])
                    and isinstance(entry[1], str) and is_fingerprint(entry[1])
                    and isinstance(entry[2], int) and not isinstance(entry[2], bool)):
                out[name] = Published(entry[0], entry[1], entry[2])
        if len(out) < len(users):
            self.notes.append(f"{self.manifest_path}: {len(users) - len(out)} malformed entr(ies) dropped; written again")
        digest = data.get("digest")
        return (digest if isinstance(digest, str) and len(out) == len(users) else ""), PublishedTable((), {}, out)

    def verify(self) -> int:
        """Check that every recorded user's folder holds what was published (by size); a user whose files
        are missing or cut short is dropped from the record, so the next write repairs it. Returns how many."""
        bad = []
        for name, entry in list(self.published.items()):
            folder = self.directory / entry.token
            try:
                size = sum(os.stat(folder / f).st_size for f in file_names(self.formats))
            except OSError:
                size = -1
            if size != entry.size:
                bad.append(name)
        for name in bad:
            self.published.drop(name)
        if bad:
            self.digest = ""
        return len(bad)

    def clean_temporaries(self) -> int:
        """Remove temporary files a killed writer left behind (never complete documents)."""
        removed = 0
        for path in self.manifest_path.parent.glob(f"{SPILL_PREFIX}*.pickle"):  # an earlier version's ``Spill``
            path.unlink(missing_ok=True)
            removed += 1
        name = self.directory.name
        for path in self.directory.parent.glob(f"{glob.escape(name)}.*.tmp"):  # a first pass's folder (``_tree``)
            if _TREE.fullmatch(path.name[len(name):]) and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
        if not self.directory.is_dir():
            return removed
        for path in self.directory.glob("*/.*.tmp"):
            path.unlink(missing_ok=True)
            removed += 1
        for path in self.directory.glob(".*.tmp"):  # a new user's staging folder
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        return removed

    def hashed(self, cluster: Cluster, digest: str) -> None:
        """``cluster``'s digest as its loader has it (``cluster_digest``, or one chained from the last by the users
        changed): a pass on it does not hash a million users again. (Kept by the cluster's id, which no other
        cluster has while this one is the loop's.)"""
        self._cluster_hash = (id(cluster), digest)

    def write(self, snapshot: Snapshot) -> WriteStats:
        with gcpause.paused():  # a pass makes millions of short-lived objects beside the snapshot's millions: no walks
            return self._write(snapshot)

    def _write(self, snapshot: Snapshot) -> WriteStats:
        start = time.perf_counter()
        cluster = snapshot.cluster
        stats = WriteStats(users=len(cluster.users))
        known = self._cluster_hash  # (read once: the loop may tell the next cluster's digest meanwhile, ``hashed``)
        if known is None or known[0] != id(cluster):
            known = self._cluster_hash = (id(cluster), cluster_digest(cluster))
        inputs = f"{known[1]}|{','.join(self.formats)}|{DOCUMENTS}"
        digest = snapshot_digest(snapshot, inputs)
        if digest == self.digest and self.directory.is_dir():
            stats.skipped_all, stats.unchanged = True, len(cluster.users)
            stats.seconds = time.perf_counter() - start
            return stats
        roster = cluster.roster
        old = self.published.aligned(roster.names, roster.index)
        existed = self.directory.is_dir()
        # Nothing there yet (a first start, a new subscriptions_dir, a folder removed): every user's folder is written
        # into a folder of the pass's own, renamed into place once all are there (``_tree``).
        into_tree = not existed and not os.path.lexists(self.directory)
        if not into_tree:
            self.directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        basis = _Basis.of(snapshot, inputs)
        changed = basis.changed(self._basis)
        n = len(cluster.users)
        # Until this pass ends well, nobody knows which files it changed: a failure (a full disk, a worker's error)
        # leaves the next pass comparing every user with what the manifest recorded.
        self._basis, self.digest = None, ""
        if changed is not None and existed:
            # The same file, keys and users: only users whose standing, usage step or inbounds changed can have
            # other documents (a million users' fingerprints each interval would be the interval's whole work).
            which, headers_only = self._with_missing(old, *changed)
            parts = self._passes(snapshot, old, which, headers_only)
            new = old  # recorded in place: the parts are all written by now (a copy was 72 MB at a million users)
            for part in parts:
                part.record(new, stats)
            stats.unchanged += n - len(which)
            self.digest, self._basis, self.published = digest, basis, new
            self._written_at = time.time()
            if time.time() - self._manifest_at >= self.MANIFEST_EVERY:
                self._write_manifest()
            # Otherwise the manifest on disk is older than some files: a restart then compares every user and
            # rewrites those, which is all an older manifest costs.
            stats.seconds = time.perf_counter() - start
            return stats
        new = PublishedTable(roster.names, roster.index)
        tree = self._tree() if into_tree else None
        try:
            parts = self._passes(snapshot, old, np.arange(n), np.zeros(n, bool), tree)
            if tree is not None:
                self._publish_tree(tree)
        finally:
            if tree is not None:  # (a failure: nothing of this pass is seen)
                shutil.rmtree(tree, ignore_errors=True)
        for part in parts:
            part.record(new, stats)
        gone = old.tokens[(old.tokens != b"") & (old.tokens != new.tokens)].tolist()  # rotated: a new folder
        for token in [t.decode() for t in gone] + [p.token for p in old.others.values()]:  # and who left the file
            if is_token(token):  # a token from a file names no path unchecked
                shutil.rmtree(self.directory / token, ignore_errors=True)
                stats.removed += 1
        self.digest, self.published, self._basis = digest, new, basis
        self._write_manifest()
        stats.seconds = time.perf_counter() - start
        return stats

    def _tree(self) -> Path:
        """A folder beside ``directory`` (the same filesystem) that a pass writing every user writes into when nothing
        is at ``directory`` yet. No reader sees a user's folder half written, as with a folder staged and renamed
        per user, and a reader sees all the users or none; each user's folder is written as it is (the staging and
        the rename were ~10% of a pass's time). Its name starts with ``directory``'s: what skips that skips it too
        (the loop's watch of the cluster file's folder). A killed writer's is removed at start-up
        (``clean_temporaries``), one this process left when its pass failed at once."""
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        tree = self.directory.with_name(f"{self.directory.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
        tree.mkdir(mode=DIR_MODE)
        return tree

    def _publish_tree(self, tree: Path) -> None:
        """``tree`` (``_tree``) renamed to ``directory``; when something appeared there meanwhile (another writer's
        folder), each user's folder moved into it on its own (a folder of that user there already: its files
        replaced one by one). (A folder made empty in the instant between the check and the rename is replaced:
        ``rename`` takes an empty folder's place, and Python has no ``RENAME_NOREPLACE``.)"""
        if not os.path.lexists(self.directory):
            try:
                os.rename(tree, self.directory)
                return
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        self.directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        for entry in os.scandir(tree):
            dest = self.directory / entry.name
            try:
                os.rename(entry.path, dest)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                for f in os.scandir(entry.path):
                    os.replace(f.path, dest / f.name)

    def _with_missing(self, old: PublishedTable, which: np.ndarray,
                      headers_only: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``which`` and the users of this pass's slice of the sweep (1/SWEEP of the users, in turn) whose folder is
        gone (removed behind the outlet's back): they are written again whole."""
        n = len(old.names)
        if not n:
            return which, headers_only
        k = -(-n // self.SWEEP)
        looked = np.arange(self._sweep, self._sweep + k) % n
        self._sweep = int((self._sweep + k) % n)
        tokens = old.tokens[looked].tolist()
        gone = looked[[not t or not os.path.isdir(os.path.join(self.directory, t.decode())) for t in tokens]]
        if not len(gone):
            return which, headers_only
        light = dict(zip(which.tolist(), headers_only.tolist(), strict=True)) | dict.fromkeys(gone.tolist(), False)
        merged = np.array(sorted(light), np.int64)
        return merged, np.array([light[i] for i in merged.tolist()], bool)

    def close(self) -> None:
        """Record the manifest if a pass since the last one left it behind (a stop: the next start reads it)."""
        if self._manifest_at < self._written_at:
            self._write_manifest()

    def _write_manifest(self) -> None:
        """The manifest as one JSON document, made in slices (a million users' entries as one dict were ~300 MB)."""
        def pieces() -> Iterator[bytes]:
            yield b'{"digest": ' + json.dumps(self.digest).encode() + b', "users": {'
            for k, members in enumerate(self.published.json_members(20_000)):
                yield (b", " if k else b"") + members
            yield b"}}"

        write_atomic(self.manifest_path, pieces(), 0o600)
        self._manifest_at = time.time()

    def _passes(self, snapshot: Snapshot, old: PublishedTable, which: np.ndarray,
                headers_only: np.ndarray, tree: Path | None = None) -> list[Part]:
        """The users at positions ``which`` looked at (and written where changed; ``headers_only``: for each, whether
        only its headers can have changed): in this process, or split with worker processes when there are many.
        Each part: its manifest entries and counts. ``tree``: written there, not in ``directory`` (``_tree``)."""
        where, unseen = str(self.directory if tree is None else tree), tree is not None
        if len(which) > STRETCH:  # in the order of their assignments: users assigned alike share document templates
            order = locality_order(list(snapshot.held.columns.values()), which)
            which, headers_only = which[order], headers_only[order]
        if len(which) < self.PARALLEL_MIN or self.workers < 2:
            return [write_users(snapshot, self.secret, where, self.formats, published_before(old, which), which,
                                headers_only, has_shadowsocks(snapshot), unseen=unseen)]
        return self._in_workers(snapshot, old, which, headers_only, where, unseen)

    def _in_workers(self, snapshot: Snapshot, old: PublishedTable, which: np.ndarray,
                    headers_only: np.ndarray, where: str, unseen: bool) -> list[Part]:
        """Worker processes and this one render and write the users from one pickled snapshot, taken in blocks
        from the two ends of one list (``parallel``): this process from the front as soon as the snapshot is pickled,
        the workers from the back once they have started and read it (~0.1 s later at 100k users), until the ends
        meet. ``which`` is in the order of the users' assignments:
        each process renders the templates of its own end of it.

        forkserver, not fork: the loop has threads (the event loop, watchfiles), and a forked child
        could inherit a lock some other thread held.
        """
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        before = published_before(old, which)
        context = multiprocessing.get_context("forkserver")
        # The server the workers are forked from imports what they run once, as it starts (a pass's workers then
        # start in ~0.3 s, not ~0.55); it lives as long as this process.
        context.set_forkserver_preload(["reconciler.publish.parallel"])
        ends = Ends(context.Array("q", [0, len(which)]))
        # The snapshot (with the pass's users) goes to the workers pickled straight into an anonymous file they inherit
        # (``Spill``): as bytes it was in memory twice more (the pickle, and the executor's own pickle of the call),
        # ~250 MB at a million users, the loop's peak. The secret travels with the call, never in the file.
        spill = Spill()
        try:
            with ProcessPoolExecutor(self.workers - 1, mp_context=context, initializer=start_worker,
                                     initargs=(ends.shared, spill)) as pool:
                for _ in range(self.workers - 1):  # the workers start while the file is written (~0.3 s at 100k users)
                    pool.submit(os.getpid)
                # Nobody published yet (a first pass): the workers make the empty columns themselves.
                fresh = not (before[0] != b"").any()
                spill.dump((spilled(snapshot), which, headers_only, None if fresh else before))
                futures = [pool.submit(write_in_worker, spill.size, self.secret, where, self.formats, unseen)
                           for _ in range(self.workers - 1)]
                try:
                    here = write_users(snapshot, self.secret, where, self.formats, before, which,
                                       headers_only, has_shadowsocks(snapshot), ends.blocks(front=True), unseen)
                finally:
                    ends.close()  # (a failure here: the workers stop after their block)
                return [here] + [f.result() for f in futures]
        finally:
            spill.close()
