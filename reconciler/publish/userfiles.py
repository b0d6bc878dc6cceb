"""Writing users' files: one folder per user (``links.txt``, ``sing-box.json``, ``clash.yaml``, ``headers.json``),
rendered whole, or only its ``headers.json`` restamped when the usage step alone changed; and the pass's counts."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from reconciler.balance import Snapshot, decide
from reconciler.balance.decide import Entry, EntryKey, decide_block
from reconciler.credentials import Secret, UserCredentials, credential_bytes, user_credentials
from reconciler.model import User
from reconciler.publish.digests import (
    FINGERPRINT_CHARS,
    entries_text,
    fingerprint_head,
    fingerprint_of,
    restepped,
    usage_steps,
)
from reconciler.publish.manifest import PublishedTable
from reconciler.state.files import write_all, write_atomic
from reconciler.subscriptions.document import (
    EXTENSIONS,
    TEMPLATES_KEPT,
    Prepared,
    credential_values,
    file_headers,
    headers_json,
    headers_json_restamped,
    prepared,
    render_formats,
    user_tag,
    userinfo,
)

# Documents are regenerated from the snapshot at will, so they are not fsynced one by one: the manifest,
# written durably after them, records each user's token, fingerprint and published size, and the sizes
# are checked at start-up (``verify``), so a document cut short (a full disk, a crash) is written again.
DOC_MODE = 0o600


DIR_MODE = 0o700


@dataclass
class WriteStats:
    users: int = 0
    written: int = 0  # users whose files were (re)written
    unchanged: int = 0
    removed: int = 0
    skipped_all: bool = False  # the snapshot digest was unchanged
    seconds: float = 0.0


#: The fewest users rendered on one copy of the snapshot. Users with the same entries share a document template, and a
#: snapshot keeps the first ``TEMPLATES_KEPT`` templates it made (``subscriptions.document``): past them, every
#: document was made from scratch (~100 µs a user at 100k users on 20 servers, 3 in a failover order: 6,840 templates
#: for sing-box and as many for clash). A big pass's users go in the order of their assignments (``locality_order``),
#: and each run of users assigned alike (short runs together, until they are this many users) is rendered on a copy of
#: the snapshot of its own (``Snapshot.with_fresh_memo``: its memo starts empty and is filled again in ~1 ms at 100k users),
#: whose templates are that run's and go with it.
STRETCH = 4096

Before = tuple[np.ndarray, np.ndarray, np.ndarray]  # what was published of some users: tokens, fingerprints, sizes


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


def has_shadowsocks(snapshot: Snapshot) -> bool:
    return any(r.inbound.protocol == "shadowsocks-2022" for r in snapshot.cluster.inbounds)


def write_users(snapshot: Snapshot, secret: Secret, directory: str, formats: tuple[str, ...], before: Before,
                which: np.ndarray, headers_only: np.ndarray, shadowsocks: bool,
                blocks: Iterable[tuple[int, int]] | None = None, unseen: bool = False, backward: bool = False) -> Part:
    """The users at these positions: fingerprint each, (re)write those that changed (only the headers where only
    they can have changed). ``before``: what was published of each of them. ``blocks``: only these ranges of them
    (``[lo, hi)`` over ``which``, as a pass in processes hands them out); None: all. ``unseen``: ``directory`` is
    this pass's own, which no reader sees before it is renamed into place (``FileOutlet``'s first pass): each user's
    folder is written as it is, not staged and renamed. ``backward``: the blocks come from the back of the list (a
    pass's worker): each is taken from its end too, so that the users follow their runs of users assigned alike
    without turning back at each block (a run turned back on began a stretch of its own, templates and all: 40% more
    templates made in a worker)."""
    cluster = snapshot.cluster
    users = cluster.users
    steps = usage_steps(cluster.roster.data_limit[which], cluster.roster.measured(snapshot.usage)[0][which])
    groups = _groups(snapshot, which)
    tokens, prints, sizes = (np.zeros(len(which), a.dtype) for a in before)
    each = _EachUser(snapshot, secret, directory, formats, shadowsocks, unseen)
    done: list[tuple[int, int]] = []
    for lo, hi in ((lo, min(len(which), lo + CHUNK)) for lo in range(0, len(which), CHUNK)) if blocks is None else blocks:
        done.append((lo, hi))
        light, had, printed = headers_only[lo:hi].tolist(), before[0][lo:hi].tolist(), before[1][lo:hi].tolist()
        # Who is decided: all but those whose headers alone are restamped, in one call (``decide_block``: users
        # assigned alike together, any other alone).
        fresh = [k for k, (li, ha, pr) in enumerate(zip(light, had, printed, strict=True))
                 if not (li and ha and len(pr) == FINGERPRINT_CHARS)]
        decided: list[tuple[list[Entry], tuple[EntryKey, ...] | None] | None] = [None] * (hi - lo)
        if fresh:
            for k, entries, key in zip(fresh, *decide_block(each.view, which[lo:hi][fresh]), strict=True):
                decided[k] = (entries, key)
        rows = list(zip(which[lo:hi].tolist(), light, had, printed, before[2][lo:hi].tolist(), steps[lo:hi].tolist(),
                        groups[lo:hi].tolist(), decided, strict=True))
        new, other = each.new, each.user  # (new: not published before, decided with others alike; most users)
        out = [new(users[i], step, group, d[0], d[1]) if not ha and d is not None and d[1] is not None
               else other(users[i], li, ha, pr, size, step, group, d)
               for i, li, ha, pr, size, step, group, d in (reversed(rows) if backward else rows)]
        if backward:
            out.reverse()
        if out:  # (read and written a block at a time: as lists for the whole pass, ~360 MB at a million users)
            tokens[lo:hi], prints[lo:hi], sizes[lo:hi] = zip(*out, strict=True)
    if blocks is None:
        return Part(which, tokens, prints, sizes, each.written, each.unchanged)
    took = np.concatenate([np.arange(lo, hi) for lo, hi in done]) if done else np.zeros(0, np.int64)
    return Part(which[took], tokens[took], prints[took], sizes[took], each.written, each.unchanged)


CHUNK = 1024  # users read and recorded at a time (when the caller hands out no blocks)


class _EachUser:
    """One call's users, one at a time (``write_users``): what they share, and what each was published as."""

    def __init__(self, snapshot: Snapshot, secret: Secret, directory: str, formats: tuple[str, ...], shadowsocks: bool,
                 unseen: bool = False):
        self.snapshot, self.secret, self.directory, self.formats, self.shadowsocks = snapshot, secret, directory, formats, shadowsocks
        self.unseen = unseen  # ``directory`` is the pass's own (``write_users``)
        cluster = snapshot.cluster
        self.inbound_json = {r.inbound.id: r.inbound.model_dump_json() for r in cluster.inbounds}
        self.outputs_json = cluster.settings.outputs.model_dump_json()
        self.view, self.fresh, self.group = snapshot, 0, -1  # the snapshot this stretch renders on, its users, their run
        self.keyed: dict[tuple[EntryKey, ...], _Keyed] = {}  # this stretch's entries by key (``decide_block``)
        self.written = self.unchanged = 0

    def new(self, user: User, step: int, group: int, entries: list[Entry],
            key: tuple[EntryKey, ...]) -> tuple[bytes, bytes, int]:
        """``user``'s answer for a user not published before and decided with others alike (``key``): most users of
        a big pass, in the fewest steps."""
        if group != self.group:
            self._stretch(group)
        self.fresh += 1
        alike = self.keyed.get(key) or self._keyed(entries, key)
        view, formats = self.view, self.formats
        documents = alike.prepared or alike.documents(view, self.secret, formats)
        values, token = credential_bytes(self.secret, user.name, user.rotate, alike.wanted, self.shadowsocks)
        name = token.decode()
        self.written += 1
        return token, fingerprint_of(alike.head, user.model_dump_json(), step).encode(), \
            _put(self.directory, name, file_names(formats), _filled(view, formats, user, name, documents, values),
                 known=False, unseen=self.unseen)

    def _stretch(self, group: int) -> None:
        """Users assigned alike end here: a stretch of users on a copy of its own (STRETCH)."""
        if self.fresh >= STRETCH:
            self.view, self.fresh, self.keyed = self.snapshot.with_fresh_memo(), 0, {}
        self.group = group

    def user(self, user: User, light: bool, had: bytes, printed: bytes, had_size: int, step: int,
             group: int, decided: tuple[list[Entry], tuple[EntryKey, ...] | None] | None) -> tuple[bytes, bytes, int]:
        """The user's token, fingerprint and size as published now, for a user published before or decided alone (a
        new one decided with others alike: ``new``). ``had``, ``printed``, ``had_size``: what was published before;
        ``light``: only its headers can have changed; ``group``: its run of users assigned alike; ``decided``: its
        entries and their key, None when only its headers are to be restamped."""
        if group != self.group:
            self._stretch(group)
        self.fresh += 1
        view, secret, directory, formats = self.view, self.secret, self.directory, self.formats
        # Only the usage step moved (the same file and keys): the same token and bodies, new figures in headers.json.
        # Its entries are the same too (its inbounds did not move), so its fingerprint is the last one at this step:
        # no decision (~30 µs a user, 20k users a pass at a million).
        stamp = decided is None and light and bool(had) and len(printed) == FINGERPRINT_CHARS
        kept: _Keyed | None = None
        if stamp:
            fp = restepped(printed, step).decode()
        else:
            entries, key = decided if decided is not None else (decide(view, user.name), None)
            kept = self._keyed(entries, key)
            fp = fingerprint_of(kept.head, user.model_dump_json(), step)
        creds = None if stamp else user_credentials(secret, user.name, user.rotate, self.shadowsocks)  # not kept (~500 B)
        token = had if creds is None else creds.token.encode()
        if had == token and printed == fp.encode() and os.path.isdir(os.path.join(directory, token.decode())):
            self.unchanged += 1
            return token, printed, had_size
        size = _restamp_userinfo(view, directory, formats, token.decode(), user, had_size) if stamp else None
        if size is None:
            if kept is None:  # the file was not ours to restamp: rendered whole, decided afresh
                kept = self._keyed(decide(view, user.name), None)
                fp = fingerprint_of(kept.head, user.model_dump_json(), step)
            if creds is None:
                creds = user_credentials(secret, user.name, user.rotate, self.shadowsocks)
            token = creds.token.encode()
            docs = kept.documents(view, secret, formats) if kept.key is not None else None
            size = _write_user(view, secret, directory, formats, user, creds.token, kept.entries, creds,
                               known=bool(had), headers_only=light and had == token, documents=docs, unseen=self.unseen)
        self.written += 1
        return token, fp.encode(), size

    def _keyed(self, entries: list[Entry], key: tuple[EntryKey, ...] | None) -> _Keyed:
        """What users with these entries share (kept by their key for this stretch; a user decided alone: its own)."""
        if key is None:
            return _Keyed(entries, None, fingerprint_head(self.outputs_json, entries_text(self.view, entries, self.inbound_json)))
        found = self.keyed.get(key)
        if found is None:
            found = _Keyed(entries, key, fingerprint_head(self.outputs_json, entries_text(self.view, entries, self.inbound_json)))
            if len(self.keyed) < TEMPLATES_KEPT:  # a stretch of users whose orders are nearly each one's own: not all
                self.keyed[key] = found
        return found


@dataclass
class _Keyed:
    """The entries of users decided alike (``decide_block``'s key; None: one user's own), their part of the users'
    fingerprints, and their documents to fill in with each one's credentials (made when first written)."""

    entries: list[Entry]
    key: tuple[EntryKey, ...] | None
    head: hashlib._Hash  # ``fingerprint_head``: what their fingerprints share, hashed
    prepared: tuple[Prepared, ...] | None = None

    wanted: tuple[bool, bool, bool, bool] = (True,) * 4  # which credentials the documents hold (``credential_bytes``)

    def documents(self, snapshot: Snapshot, secret: Secret, formats: tuple[str, ...]) -> tuple[Prepared, ...]:
        if self.prepared is None:
            self.prepared = tuple(prepared(snapshot, self.entries, fmt, secret) for fmt in formats)
            held = {slot for p in self.prepared for slot in p.slots}
            self.wanted = (0 in held, 1 in held, 2 in held, 3 in held)
        return self.prepared


def _groups(snapshot: Snapshot, which: np.ndarray) -> np.ndarray:
    """For each of these users, which run of users with the same assignments it is in (one number per run)."""
    change = np.zeros(len(which), bool)
    for col in snapshot.held.columns.values():
        at = col[which]
        change[1:] |= at[1:] != at[:-1]
    groups: np.ndarray = np.cumsum(change)
    return groups


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


_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


@functools.lru_cache(maxsize=8)
def file_names(formats: tuple[str, ...]) -> tuple[str, ...]:
    """A user's files: one document per format, then ``headers.json``."""
    return (*(f"{fmt}.{EXTENSIONS[fmt]}" for fmt in formats), "headers.json")


def _write_user(snapshot: Snapshot, secret: Secret, directory: str, formats: tuple[str, ...], user: User, token: str,
                entries: list[Entry], creds: UserCredentials, known: bool = True, headers_only: bool = False,
                documents: tuple[Prepared, ...] | None = None, unseen: bool = False) -> int:
    """Write one user's files (``headers_only``: the bodies are known to be the same, only ``headers.json`` is
    written); returns their size together (what the manifest records). ``documents``: the user's documents to fill
    in (a served user decided with others alike); else rendered (``render_formats``: also a refusal)."""
    names = file_names(formats)
    if documents is not None:  # (served: ``decide_block`` keys only served users' entries)
        contents = _filled(snapshot, formats, user, token, documents, credential_values(creds))
    else:
        docs = render_formats(snapshot, user.name, formats, secret, entries=entries, credentials=creds)
        contents = [*(docs[fmt].body for fmt in formats), headers_json(snapshot, docs)]
    return _put(directory, token, names, contents, known, headers_only, unseen)


def _put(directory: str, token: str, names: tuple[str, ...], contents: list[bytes], known: bool,
         headers_only: bool = False, unseen: bool = False) -> int:
    """A user's files (``names``, ``contents``) in its folder (a new folder: staged and renamed into place, or written
    as it is in a folder no reader sees yet, ``unseen``; ``headers_only``: only ``headers.json`` replaced); their size
    together."""
    size = sum(map(len, contents))
    folder = f"{directory}/{token}"
    if unseen:
        try:
            _write_folder(folder, names, contents)
            return size
        except FileExistsError:  # (two users with one token: none of ours) its files replaced one by one, below
            known = True
    if (not known or not os.path.isdir(folder)) and _staged(directory, token, names, contents):
        return size
    for name, data in zip(names, contents, strict=True):
        if not headers_only or name == "headers.json":  # a usage step changes one file of four
            write_atomic(f"{folder}/{name}", data, DOC_MODE, sync=False)
    return size


def _filled(snapshot: Snapshot, formats: tuple[str, ...], user: User, token: str, documents: tuple[Prepared, ...],
            values: tuple[bytes, ...]) -> list[bytes]:
    """A served user's files (``file_names``' order): its documents filled in, and their headers."""
    mine = user_tag(token)
    out = [p.fill_values(values) for p in documents]
    out.append(file_headers(snapshot, formats, [p.etag(mine) for p in documents], userinfo(snapshot, user)))
    return out


def _staged(directory: str, token: str, names: tuple[str, ...], contents: list[bytes]) -> bool:
    """Put a new user's folder in place: its files written into a hidden folder, renamed into place — readers see
    all of it or none, with one rename instead of one per file. False when the folder appeared meanwhile (another
    writer): the caller replaces its files one by one. (A staging folder a killed writer left is removed at
    start-up, see ``FileOutlet.clean_temporaries``; one left by this process is removed here.)"""
    staging = f"{directory}/.{token}.{_PID[0]}.tmp"
    try:
        _write_folder(staging, names, contents)
    except FileExistsError:
        shutil.rmtree(staging)
        _write_folder(staging, names, contents)
    try:
        os.rename(staging, f"{directory}/{token}")
        return True
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        return False


def _write_folder(folder: str, names: tuple[str, ...], contents: list[bytes]) -> None:
    """A new folder (``FileExistsError`` when it is there) with these files in it."""
    os.mkdir(folder, DIR_MODE)
    for name, data in zip(names, contents, strict=True):  # (``write_new``'s steps, for 400,000 files a pass)
        fd = os.open(f"{folder}/{name}", _NEW, DOC_MODE)
        try:
            if (n := os.write(fd, data)) != len(data):
                write_all(fd, data[n:])
        finally:
            os.close(fd)


_PID = [os.getpid()]  # this process's (a worker's own once it starts: ``os.register_at_fork``)
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))
