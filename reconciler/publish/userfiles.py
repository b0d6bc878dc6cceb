"""Writing users' files: one folder per user (``links.txt``, ``sing-box.json``, ``clash.yaml``, ``headers.json``),
rendered whole, or only its ``headers.json`` restamped when the usage step alone changed; and the pass's counts."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import numpy as np

from reconciler.balance import Snapshot, decide
from reconciler.balance.decide import Entry
from reconciler.credentials import Secret, UserCredentials, user_credentials
from reconciler.model import User
from reconciler.publish.digests import FINGERPRINT_CHARS, restepped, usage_steps, user_fingerprint
from reconciler.publish.manifest import PublishedTable
from reconciler.state.files import write_atomic, write_new
from reconciler.subscriptions.document import EXTENSIONS, headers_json, headers_json_restamped, render_formats, userinfo

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
                 which: np.ndarray, headers_only: np.ndarray, shadowsocks: bool) -> Part:
    """The users at these positions: fingerprint each, (re)write those that changed (only the headers where only
    they can have changed). ``before``: what was published of each of them."""
    cluster = snapshot.cluster
    inbound_json = {r.inbound.id: r.inbound.model_dump_json() for r in cluster.inbounds}
    outputs_json = cluster.settings.outputs.model_dump_json()
    tokens, prints, sizes = (np.zeros(len(which), a.dtype) for a in before)
    written = unchanged = 0
    users = cluster.users
    steps = usage_steps(cluster.roster.data_limit[which], cluster.roster.measured(snapshot.usage)[0][which]).tolist()
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
