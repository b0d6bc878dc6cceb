"""Where decisions go: subscription files for every user, and the live answers' cache.

Both outlets call the same pure ``render`` on the same snapshot, so a file and
a live response for one user agree byte for byte (and so do their ETags).

Files: ``<subscriptions_dir>/<token>/{links.txt, sing-box.json, clash.yaml, headers.json}``
(folders 0700, files 0600: they hold credentials; give the web server that publishes them the
owner or a group by the service's own means)
— a static host or object store serves ``/sub/<token>/…`` without knowing us;
``headers.json`` carries the headers clients read (for an uploader that sets
them). Each file is written to a temporary name and renamed over the old one,
so a reader (or a crash) never sees a part. Only users whose document inputs
changed are rendered again: a fingerprint per user (the user, their entries,
the inbounds and keys those entries name) is kept in the state folder, and a
digest of the whole snapshot's inputs skips even that when nothing changed.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np

from reconciler.balance import Snapshot, decide
from reconciler.balance.assignments import Assignments
from reconciler.balance.decide import Entry
from reconciler.credentials import TOKEN_CHARS, Secret, UserCredentials, is_token, user_credentials, user_token
from reconciler.model import Cluster, User, UserUsage
from reconciler.model.roster import ACTIVE, NO_LIMIT, STANDINGS
from reconciler.safe_read import read_regular_file
from reconciler.state.files import Mac, mac_matches, make_private_dirs, write_atomic, write_new
from reconciler.subscriptions import FORMATS, Document, render
from reconciler.subscriptions.document import EXTENSIONS, headers_json, headers_json_restamped, render_formats, userinfo

MANIFEST = "subscription-files.json"
#: The most the manifest may hold. A user's entry is ~96 bytes (``"user-123456": ["<token>", "<fingerprint>",
#: 12345], ``), 162 at most (a 63-character name, a 19-digit size): a million users' manifest is ~92 MiB, 155 MiB
#: at the longest; a bigger file is not one the loop wrote, and is not read (every user's files are written again).
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
FINGERPRINT_CHARS = 32  # user_fingerprint: hex
STEP_HEX = 16  # a fingerprint's last characters are the usage step: a step alone is stamped without deciding again
# Documents are regenerated from the snapshot at will, so they are not fsynced one by one: the manifest,
# written durably after them, records each user's token, fingerprint and published size, and the sizes
# are checked at start-up (``verify``), so a document cut short (a full disk, a crash) is written again.
DOC_MODE = 0o600
DIR_MODE = 0o700


class Published(NamedTuple):
    """What the manifest records of one user's folder."""

    token: str
    fingerprint: str
    size: int  # bytes of all its files together


class PublishedTable(Mapping[str, Published]):
    """user → what was published of its files, as columns over a cluster's users (a dict of a million named tuples
    of two strings was ~370 MB), and a small dict beside for users the columns do not hold (who left the file).
    An empty token: nothing recorded for that user."""

    def __init__(self, names: tuple[str, ...], position: Mapping[str, int],
                 others: dict[str, Published] | None = None) -> None:
        n = len(names)
        self.names, self._at = names, position
        self.tokens = np.zeros(n, f"S{TOKEN_CHARS}")
        self.prints = np.zeros(n, f"S{FINGERPRINT_CHARS}")
        self.sizes = np.zeros(n, np.int64)
        self.others: dict[str, Published] = others if others is not None else {}

    @classmethod
    def of(cls, entries: Mapping[str, Published], names: tuple[str, ...], position: Mapping[str, int]) -> PublishedTable:
        table = cls(names, position)
        for name, p in entries.items():
            i = position.get(name)
            if i is None:
                table.others[name] = p
            else:
                table.tokens[i], table.prints[i], table.sizes[i] = p.token.encode(), p.fingerprint.encode(), p.size
        return table

    def aligned(self, names: tuple[str, ...], position: Mapping[str, int]) -> PublishedTable:
        """The same records over other users (the cluster's); records of users not among them go to ``others``."""
        if names is self.names:
            return self
        return PublishedTable.of(self, names, position)

    def at(self, i: int) -> Published | None:
        token = self.tokens[i]
        return Published(token.decode(), self.prints[i].decode(), int(self.sizes[i])) if token else None

    def drop(self, name: str) -> None:
        i = self._at.get(name)
        if i is not None:
            self.tokens[i] = b""
        self.others.pop(name, None)

    def __getitem__(self, name: str) -> Published:
        i = self._at.get(name)
        found = self.at(i) if i is not None else self.others.get(name)
        if found is None:
            raise KeyError(name)
        return found

    def __iter__(self) -> Iterator[str]:
        names = self.names
        for i in np.flatnonzero(self.tokens != b"").tolist():
            yield names[i]
        yield from list(self.others)

    def __len__(self) -> int:
        return int(np.count_nonzero(self.tokens != b"")) + len(self.others)


class Tokens:
    """Subscription token ↔ user, derived from the master secret; credentials cached per user and rotation."""

    def __init__(self, secret: Secret, shadowsocks: bool = True):
        self.secret = secret
        self.shadowsocks = shadowsocks  # False only where no document can hold a Shadowsocks key
        self._by_user: dict[tuple[str, int], UserCredentials] = {}
        self._index = TokenIndex((), ())
        self._cluster_id: int | None = None

    def credentials(self, user: str, rotate: int) -> UserCredentials:
        key = (user, rotate)
        creds = self._by_user.get(key)
        if creds is None:
            creds = self._by_user[key] = user_credentials(self.secret, user, rotate, self.shadowsocks)
        return creds

    def token(self, user: str, rotate: int) -> str:
        creds = self._by_user.get((user, rotate))
        return creds.token if creds is not None else user_token(self.secret, user, rotate)

    def index(self, cluster: Cluster) -> TokenIndex:
        """token → user name for the cluster's users (rebuilt when the cluster changes; one HMAC per user)."""
        if self._cluster_id != id(cluster):
            self._index = TokenIndex((self.token(u.name, u.rotate) for u in cluster.users), cluster.roster.names)
            self._cluster_id = id(cluster)
        return self._index


class TokenIndex:
    """Subscription token → user name, as a sorted array of the tokens (a dict of a million was ~190 MB)."""

    WIDTH = TOKEN_CHARS  # 192 bits in URL-safe base64

    def __init__(self, tokens: Iterable[str], names: tuple[str, ...]) -> None:
        raw = np.zeros(len(names), f"S{self.WIDTH}")
        for i, token in enumerate(tokens):  # filled one by one: a million tokens as a list first were ~130 MB more
            raw[i] = token.encode()
        order = np.argsort(raw, kind="stable")
        self._tokens, self._users, self._names = raw[order], order.astype(np.int64), names

    def get(self, token: str) -> str | None:
        """The user whose token this is; None for any other text (a request's path: hostile)."""
        key = token.encode(errors="replace")
        if len(key) != self.WIDTH or not len(self._tokens):
            return None
        i = int(np.searchsorted(self._tokens, key))
        if i < len(self._tokens) and self._tokens[i] == key:
            return self._names[int(self._users[i])]
        return None

    def __len__(self) -> int:
        return len(self._tokens)


def cluster_digest(cluster: Cluster) -> str:
    return hashlib.sha256(cluster.model_dump_json().encode()).hexdigest()


def snapshot_digest(snapshot: Snapshot, cluster_hash: str) -> str:
    """Everything a document can depend on, in one hash: if it is unchanged, no document changed."""
    h = hashlib.sha256(cluster_hash.encode())
    v = snapshot.verdicts
    if v is not None:
        h.update(v.status.tobytes())
        h.update(v.in_rotation.tobytes())
        assert v.regional is not None
        h.update(v.regional.tobytes())  # out of rotation for one region only (HEALTH-15)
        h.update(repr(sorted(v.pair_marks)).encode())
    held = snapshot.held  # columns over the users in the file's order, which the cluster hash holds
    h.update("\0".join([*held.inbounds, "", *held.columns]).encode())
    for col in held.columns.values():
        h.update(col.tobytes())
    h.update(json.dumps([snapshot.public_keys, snapshot.tls_pins], sort_keys=True).encode())
    roster = snapshot.cluster.roster
    codes = snapshot.standings
    h.update(",".join(f"{roster.names[i]}:{STANDINGS[codes[i]]}" for i in np.flatnonzero(codes != ACTIVE).tolist()).encode())
    h.update(_steps(roster.data_limit, roster.measured(snapshot.usage)[0]).tobytes())  # userinfo, in the users' order
    return h.hexdigest()


USAGE_STEP = 100_000_000  # bytes: the files' subscription-userinfo follows usage in steps (the live endpoint exactly)


def usage_step(snapshot: Snapshot, user_name: str) -> int:
    """Which step of usage the user's files show: they are rewritten when usage crosses a step (100 MB, or 1% of
    a limit under 10 GB), not at every interval of traffic — at a million users, rewriting every active user's
    four files each interval would be the disk's whole work. The live endpoint answers with the exact figures;
    a standing change (over quota) rewrites at once (the refusal)."""
    return _step(snapshot.cluster.user(user_name), snapshot.usage.get(user_name))


def _step(user: User, used: UserUsage | None) -> int:
    limit = NO_LIMIT if user.data_limit is None else user.data_limit
    return 0 if used is None else int(_steps(np.array([limit], np.int64), np.array([used.used], np.int64))[0])


def _steps(limit: np.ndarray, used: np.ndarray) -> np.ndarray:
    """The usage step of each user (``usage_step``): bytes used over 100 MB, or over 1% of a limit under 10 GB."""
    step = np.where(limit > 0, np.clip(limit // 100, 1, USAGE_STEP), USAGE_STEP)
    steps: np.ndarray = used // step
    return steps


def user_fingerprint(snapshot: Snapshot, user_name: str, inbound_json: dict[str, str], outputs_json: str,
                     entries: list[Entry] | None = None, step: int | None = None) -> str:
    """What the user's documents depend on: the user, the output settings, their entries, those inbounds and keys,
    and the usage step (``step``: the caller's, from ``_steps`` over every user)."""
    entries = decide(snapshot, user_name) if entries is None else entries
    user = snapshot.cluster.user(user_name)
    parts = [user.model_dump_json(), outputs_json]
    for e in entries:
        ib = e.ref.inbound.id
        parts.append(f"{e.route.id}\0{ib}\0{e.name}\0{inbound_json[ib]}\0{snapshot.public_keys.get(ib, '')}"
                     f"\0{snapshot.tls_pins.get(ib, '')}")
    base = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:FINGERPRINT_CHARS - STEP_HEX]
    return base + _step_hex(usage_step(snapshot, user_name) if step is None else step)


def _step_hex(step: int) -> str:
    return f"{step & ((1 << 64) - 1):016x}"


def restepped(fingerprint: bytes, step: int) -> bytes:
    """The fingerprint of the same documents at another usage step (``user_fingerprint``'s last characters)."""
    return fingerprint[:FINGERPRINT_CHARS - STEP_HEX] + _step_hex(step).encode()


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
                   _steps(roster.data_limit, roster.measured(snapshot.usage)[0]), snapshot.held)

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


@dataclass
class WriteStats:
    users: int = 0
    written: int = 0  # users whose files were (re)written
    unchanged: int = 0
    removed: int = 0
    skipped_all: bool = False  # the snapshot digest was unchanged
    seconds: float = 0.0


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
                    and isinstance(entry[1], str) and isinstance(entry[2], int) and not isinstance(entry[2], bool)):
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
                size = sum(os.stat(folder / f).st_size for f in self._file_names)
            except OSError:
                size = -1
            if size != entry.size:
                bad.append(name)
        for name in bad:
            self.published.drop(name)
        if bad:
            self.digest = ""
        return len(bad)

    @property
    def _file_names(self) -> list[str]:
        return [f"{fmt}.{EXTENSIONS[fmt]}" for fmt in self.formats] + ["headers.json"]

    def clean_temporaries(self) -> int:
        """Remove temporary files a killed writer left behind (never complete documents)."""
        removed = 0
        for path in self.manifest_path.parent.glob(f"{SPILL_PREFIX}*.pickle"):  # a pass's snapshot for its workers
            path.unlink(missing_ok=True)
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

    def write(self, snapshot: Snapshot) -> WriteStats:
        start = time.perf_counter()
        cluster = snapshot.cluster
        stats = WriteStats(users=len(cluster.users))
        if self._cluster_hash is None or self._cluster_hash[0] != id(cluster):
            self._cluster_hash = (id(cluster), cluster_digest(cluster))
        digest = snapshot_digest(snapshot, self._cluster_hash[1] + "|" + ",".join(self.formats))
        if digest == self.digest and self.directory.is_dir():
            stats.skipped_all, stats.unchanged = True, len(cluster.users)
            stats.seconds = time.perf_counter() - start
            return stats
        roster = cluster.roster
        old = self.published.aligned(roster.names, roster.index)
        existed = self.directory.is_dir()
        self.directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        basis = _Basis.of(snapshot, self._cluster_hash[1] + "|" + ",".join(self.formats))
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
        for part in self._passes(snapshot, old, np.arange(n), np.zeros(n, bool)):
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
        table = self.published
        names = list(table)

        def pieces() -> Iterator[bytes]:
            yield b'{"digest": ' + json.dumps(self.digest).encode() + b', "users": {'
            for lo in range(0, len(names), 20_000):
                yield ", ".join(f"{json.dumps(name)}: {json.dumps(list(table[name]))}"
                                for name in names[lo:lo + 20_000]).encode() + (b", " if lo + 20_000 < len(names) else b"")
            yield b"}}"

        write_atomic(self.manifest_path, pieces(), 0o600)
        self._manifest_at = time.time()

    def _passes(self, snapshot: Snapshot, old: PublishedTable, which: np.ndarray,
                headers_only: np.ndarray) -> list[Part]:
        """The users at positions ``which`` looked at (and written where changed; ``headers_only``: for each, whether
        only its headers can have changed): in this process, or split with worker processes when there are many.
        Each part: its manifest entries and counts."""
        if len(which) < self.PARALLEL_MIN or self.workers < 2:
            return [_write_users(snapshot, self.secret, str(self.directory), self.formats, _before(old, which), which,
                                 headers_only, _has_shadowsocks(snapshot))]
        return self._in_workers(snapshot, old, which, headers_only)

    def _in_workers(self, snapshot: Snapshot, old: PublishedTable, which: np.ndarray,
                    headers_only: np.ndarray) -> list[Part]:
        """Worker processes render and write slices of the users from one pickled snapshot; this process
        takes the first slice meanwhile (a bigger one: the workers start ~2 s later).

        forkserver, not fork: the loop has threads (the event loop, watchfiles), and a forked child
        could inherit a lock some other thread held.
        """
        import multiprocessing
        import pickle
        from concurrent.futures import ProcessPoolExecutor

        n = len(which)
        extra = self.workers - 1
        head = round(n * 0.6) if extra == 1 else n // self.workers
        bounds = [head + round(i * (n - head) / extra) for i in range(extra + 1)]
        # The snapshot goes to the workers as a file in the state folder, pickled straight into it: as bytes it was
        # in memory twice more (the pickle, and the executor's own pickle of the call), ~250 MB at a million users,
        # the loop's peak. The secret travels with the call, never in the file; the call carries the file's HMAC
        # too, and a worker unpickles only the bytes it checked (a file swapped in the folder is refused).
        spill = self.manifest_path.parent / f"{SPILL_PREFIX}{os.getpid()}.{os.urandom(4).hex()}.pickle"
        make_private_dirs(spill.parent)
        try:
            mac = _SpillMac(self.secret)
            with open(os.open(spill, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                pickle.dump(snapshot, _Tee(f, mac.update), protocol=pickle.HIGHEST_PROTOCOL)
            with ProcessPoolExecutor(extra, mp_context=multiprocessing.get_context("forkserver")) as pool:
                futures = []
                for lo, hi in zip(bounds, bounds[1:], strict=False):
                    mine = which[lo:hi]
                    futures.append(pool.submit(_worker, str(spill), mac.hexdigest(), self.secret, str(self.directory),
                                               self.formats, _before(old, mine), mine, headers_only[lo:hi]))
                here = _write_users(snapshot, self.secret, str(self.directory), self.formats, _before(old, which[:head]),
                                    which[:head], headers_only[:head], _has_shadowsocks(snapshot))
                return [here] + [f.result() for f in futures]
        finally:
            spill.unlink(missing_ok=True)


SPILL_PREFIX = ".outlet-snapshot."  # the snapshot file of a pass in worker processes (state folder; see _in_workers)


def _spill_key(secret: Secret) -> bytes:
    """The HMAC key of a pass's snapshot file."""
    return secret.derive("outlet-snapshot-file")


class _SpillMac(Mac):
    """The HMAC of a pass's snapshot file, keyed from the master secret (checked by ``mac_matches``)."""

    def __init__(self, secret: Secret) -> None:
        super().__init__(_spill_key(secret))


class _Tee:
    """A writable file that also hands every piece written to ``also``."""

    def __init__(self, f: BinaryIO, also: Callable[[bytes], object]) -> None:
        self._f, self._also = f, also

    def write(self, data: bytes) -> int:
        self._also(data)
        return self._f.write(data)


def _worker(spill: str, mac: str, secret: Secret, directory: str, formats: tuple[str, ...], before: Before,
            which: np.ndarray, headers_only: np.ndarray) -> Part:
    import pickle

    with open(spill, "rb") as f:
        data = f.read()
    if not mac_matches(_spill_key(secret), data, mac):  # not the file the pass wrote: never unpickled
        raise RuntimeError(f"the snapshot file {spill} is not the one this pass wrote")
    snapshot = pickle.loads(data)
    del data
    return _write_users(snapshot, secret, directory, formats, before, which, headers_only, _has_shadowsocks(snapshot))


Before = tuple[np.ndarray, np.ndarray, np.ndarray]  # what was published of some users: tokens, fingerprints, sizes


def _before(table: PublishedTable, which: np.ndarray) -> Before:
    return table.tokens[which], table.prints[which], table.sizes[which]


@dataclass
class Part:
    """What one pass over some users (positions ``which``) published, and how many it wrote."""

    which: np.ndarray
    tokens: np.ndarray
    prints: np.ndarray
    sizes: np.ndarray
    written: int
    unchanged: int

    def record(self, table: PublishedTable, stats: WriteStats) -> None:
        table.tokens[self.which], table.prints[self.which], table.sizes[self.which] = self.tokens, self.prints, self.sizes
        stats.written += self.written
        stats.unchanged += self.unchanged


def _has_shadowsocks(snapshot: Snapshot) -> bool:
    return any(r.inbound.protocol == "shadowsocks-2022" for r in snapshot.cluster.inbounds)


def _write_users(snapshot: Snapshot, secret: Secret, directory: str, formats: tuple[str, ...], before: Before,
                 which: np.ndarray, headers_only: np.ndarray, shadowsocks: bool) -> Part:
    """The users at these positions: fingerprint each, (re)write those that changed (only the headers where only
    they can have changed). ``before``: what was published of each of them."""
    cluster = snapshot.cluster
    inbound_json = {r.inbound.id: r.inbound.model_dump_json() for r in cluster.inbounds}
    outputs_json = cluster.settings.outputs.model_dump_json()
    tokens, prints, sizes = (np.zeros(len(which), a.dtype) for a in before)
    written = unchanged = 0
    users = cluster.users
    steps = _steps(cluster.roster.data_limit[which], cluster.roster.measured(snapshot.usage)[0][which]).tolist()
    for k, (i, light) in enumerate(zip(which.tolist(), headers_only.tolist(), strict=True)):
        user = users[i]
        had, printed = bytes(before[0][k]), bytes(before[1][k])
        # Only the usage step moved (the same file and keys): the same token and bodies, new figures in headers.json.
        # Its entries are the same too (its inbounds did not move), so its fingerprint is the last one at this step:
        # no decision (~30 µs a user, 20k users a pass at a million).
        stamp = light and bool(had) and len(printed) == FINGERPRINT_CHARS
        entries: list[Entry] | None = None
        if stamp:
            fp = restepped(printed, steps[k]).decode()
        else:
            entries = decide(snapshot, user.name)
            fp = user_fingerprint(snapshot, user.name, inbound_json, outputs_json, entries, steps[k])
        creds = None if stamp else user_credentials(secret, user.name, user.rotate, shadowsocks)  # not kept (~500 B)
        token = had if creds is None else creds.token.encode()
        if (had == token and printed == fp.encode()
                and os.path.isdir(os.path.join(directory, token.decode()))):
            tokens[k], prints[k], sizes[k] = token, before[1][k], before[2][k]
            unchanged += 1
            continue
        size = _restamp_userinfo(snapshot, directory, formats, token.decode(), user, int(before[2][k])) if stamp else None
        if size is None:
            if entries is None:  # the file was not ours to restamp: rendered whole, decided afresh
                entries = decide(snapshot, user.name)
                fp = user_fingerprint(snapshot, user.name, inbound_json, outputs_json, entries, steps[k])
            if creds is None:
                creds = user_credentials(secret, user.name, user.rotate, shadowsocks)
            token = creds.token.encode()
            size = _write_user(snapshot, secret, directory, formats, user.name, creds.token, entries, creds,
                               known=bool(had), headers_only=light and had == token)
        tokens[k], prints[k], sizes[k] = token, fp.encode(), size
        written += 1
    return Part(which, tokens, prints, sizes, written, unchanged)


HEADERS_MAX = 1 << 16  # a headers.json this long or longer is not one the outlet wrote (a few formats: < 2 kB)


def _restamp_userinfo(snapshot: Snapshot, directory: str, formats: tuple[str, ...], token: str, user: User,
                      size: int) -> int | None:
    """A user's ``headers.json`` with this interval's ``subscription-userinfo`` (``headers_json_restamped``): the
    folder's new size. Rendering the bodies again (and deriving the user's keys) cost ~4x this for the same bytes.
    None when the file is not one this outlet wrote: the caller renders the user whole."""
    path = f"{directory}/{token}/headers.json"
    try:  # os.read, not open().read(1 MB): that allocates the whole megabyte first (~20 µs a user, 10k users a pass)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # non-blocking: a FIFO there never hangs us
        try:
            old = os.read(fd, HEADERS_MAX)
        finally:
            os.close(fd)
    except OSError:
        return None
    if len(old) >= HEADERS_MAX:  # no headers.json of ours is this long: render the user whole
        return None
    new = headers_json_restamped(snapshot, old, formats, userinfo(snapshot, user))
    if new is None:
        return None
    write_atomic(path, new, DOC_MODE, sync=False)
    return size - len(old) + len(new)


def _write_user(snapshot: Snapshot, secret: Secret, directory: str, formats: tuple[str, ...], user: str, token: str,
                entries: list[Entry], creds: UserCredentials, known: bool = True, headers_only: bool = False) -> int:
    """Write one user's files (``headers_only``: the bodies are known to be the same, only ``headers.json`` is
    written); returns their size together (what the manifest records)."""
    docs = render_formats(snapshot, user, formats, secret, entries=entries, credentials=creds)
    files = {f"{fmt}.{EXTENSIONS[fmt]}": doc.body for fmt, doc in docs.items()}
    files["headers.json"] = headers_json(snapshot, docs)
    folder = f"{directory}/{token}"
    if not known or not os.path.isdir(folder):
        # A new user: fill a hidden folder, then rename it into place — readers see all of it or none,
        # with one rename instead of one per file. (A staging folder a killed writer left is removed
        # at start-up, see clean_temporaries; one left by this process is removed here.)
        staging = f"{directory}/.{token}.{os.getpid()}.tmp"
        try:
            os.mkdir(staging, DIR_MODE)
        except FileExistsError:
            shutil.rmtree(staging)
            os.mkdir(staging, DIR_MODE)
        for name, data in files.items():
            write_new(f"{staging}/{name}", data, DOC_MODE, sync=False)
        try:
            os.rename(staging, folder)
            return sum(len(d) for d in files.values())
        except OSError:  # it appeared meanwhile (another writer): replace file by file below
            shutil.rmtree(staging, ignore_errors=True)
    for name, data in files.items():
        if not headers_only or name == "headers.json":  # a usage step changes one file of four
            write_atomic(f"{folder}/{name}", data, DOC_MODE, sync=False)
    return sum(len(d) for d in files.values())


class LiveAnswers:
    """Per-snapshot cache of rendered documents for the HTTP endpoint (same function as the files)."""

    FREEZE_EVERY = 2000  # newly cached documents between two freezes (see ``answer``)

    def __init__(self, secret: Secret, tokens: Tokens):
        self.secret = secret
        self.tokens = tokens
        self.snapshot: Snapshot | None = None
        self._cache: dict[tuple[str, str, str | None], Document] = {}
        self._published = 0
        self._fresh = 0  # documents cached since the last freeze

    def publish(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self._cache = {}
        self.tokens.index(snapshot.cluster)
        if snapshot.cluster.users:  # the snapshot's shared memos (user keys, assignment counts, placements): not on a request
            decide(snapshot, snapshot.cluster.users[0].name)
        self._published += 1
        # A snapshot of many users is millions of long-lived objects; the cyclic GC would walk all of them
        # in every full collection (~100 ms pauses under load). Freezing moves what exists now out of its
        # sight; the old snapshot is still freed by reference counting. Now and then a real collection
        # clears any cycles that were frozen with it.
        if self._published % 100 == 0:
            gc.unfreeze()
            gc.collect()
        gc.freeze()

    def user_of(self, token: str) -> str | None:
        if self.snapshot is None:
            return None
        return self.tokens.index(self.snapshot.cluster).get(token)

    def answer(self, user: str, fmt: str, region: str | None = None) -> Document:
        snapshot = self.snapshot
        assert snapshot is not None
        key = (user, fmt, region)
        doc = self._cache.get(key)
        if doc is None:
            try:
                rotate = snapshot.cluster.user(user).rotate
            except KeyError:
                return render(snapshot, user, fmt, self.secret, region=region)
            creds = self.tokens.credentials(user, rotate)  # derived on the user's first request, then kept
            doc = self._cache[key] = render_formats(snapshot, user, (fmt,), self.secret, region, credentials=creds)[fmt]
            self._fresh += 1
            if self._fresh >= self.FREEZE_EVERY:
                # The cache lives as long as the snapshot, as the snapshot does: out of the cyclic GC's sight too.
                # Left in it, 100k users' documents made every full collection a ~200 ms pause under load (p99
                # 180 ms at 100k users against 1.6 ms without one). The young generations are collected first
                # so that little garbage is frozen with them (``publish`` clears it every 100 snapshots).
                self._fresh = 0
                gc.collect(1)
                gc.freeze()
        return doc
