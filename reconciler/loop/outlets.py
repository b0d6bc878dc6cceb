"""Where decisions go: subscription files for every user, and the live answers' cache.

Both outlets call the same pure ``render`` on the same snapshot, so a file and
a live response for one user agree byte for byte (and so do their ETags).

Files: ``<subscriptions_dir>/<token>/{links.txt, sing-box.json, clash.yaml, headers.json}``
— a static host or object store serves ``/sub/<token>/…`` without knowing us;
``headers.json`` carries the headers clients read (for an uploader that sets
them). Each file is written to a temporary name and renamed over the old one,
so a reader (or a crash) never sees a part. Only users whose document inputs
changed are rendered again: a fingerprint per user (the user, their entries,
the inbounds and keys those entries name) is kept in the state folder, and a
digest of the whole snapshot's inputs skips even that when nothing changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from reconciler.balance import Snapshot, decide
from reconciler.credentials import Secret, user_credentials
from reconciler.loop.learned import write_atomic
from reconciler.model import Cluster
from reconciler.subscriptions import FORMATS, Document, render
from reconciler.subscriptions.document import EXTENSIONS

MANIFEST = "subscription-files.json"


class Tokens:
    """Subscription token ↔ user, derived from the master secret (cached per user and rotation)."""

    def __init__(self, secret: Secret):
        self.secret = secret
        self._by_user: dict[tuple[str, int], str] = {}
        self._index: dict[str, str] = {}
        self._cluster_id: int | None = None

    def token(self, user: str, rotate: int) -> str:
        key = (user, rotate)
        tok = self._by_user.get(key)
        if tok is None:
            tok = self._by_user[key] = user_credentials(self.secret, user, rotate).token
        return tok

    def index(self, cluster: Cluster) -> dict[str, str]:
        """token → user name for the cluster's users (rebuilt when the cluster changes)."""
        if self._cluster_id != id(cluster):
            self._index = {self.token(u.name, u.rotate): u.name for u in cluster.users}
            self._cluster_id = id(cluster)
        return self._index


def cluster_digest(cluster: Cluster) -> str:
    return hashlib.sha256(cluster.model_dump_json().encode()).hexdigest()


def snapshot_digest(snapshot: Snapshot, cluster_hash: str) -> str:
    """Everything a document can depend on, in one hash: if it is unchanged, no document changed."""
    h = hashlib.sha256(cluster_hash.encode())
    v = snapshot.verdicts
    if v is not None:
        h.update(v.status.tobytes())
        h.update(v.in_rotation.tobytes())
        h.update(repr(sorted(v.pair_marks)).encode())
    h.update("\n".join(f"{u}\0{r}\0{i}" for (u, r), i in sorted(snapshot.assignments.items())).encode())
    h.update(json.dumps([snapshot.public_keys, snapshot.tls_pins], sort_keys=True).encode())
    h.update(",".join(u.name for u in snapshot.cluster.users if not snapshot.user_active(u)).encode())
    return h.hexdigest()


def user_fingerprint(snapshot: Snapshot, user_name: str, inbound_json: dict[str, str]) -> str:
    entries = decide(snapshot, user_name)
    user = snapshot.cluster.user(user_name)
    parts = [user.model_dump_json(), snapshot.cluster.settings.outputs.model_dump_json()]
    for e in entries:
        ib = e.ref.inbound.id
        parts.append(f"{e.route.id}\0{ib}\0{e.name}\0{inbound_json[ib]}\0{snapshot.public_keys.get(ib, '')}"
                     f"\0{snapshot.tls_pins.get(ib, '')}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


@dataclass
class WriteStats:
    users: int = 0
    written: int = 0  # users whose files were (re)written
    unchanged: int = 0
    removed: int = 0
    skipped_all: bool = False  # the snapshot digest was unchanged
    seconds: float = 0.0


class FileOutlet:
    def __init__(self, directory: Path, state_dir: Path, secret: Secret, tokens: Tokens | None = None,
                 formats: Iterable[str] = FORMATS):
        self.directory = directory
        self.manifest_path = state_dir / MANIFEST
        self.secret = secret
        self.tokens = tokens or Tokens(secret)
        self.formats = tuple(formats)
        self._cluster_hash: tuple[int, str] | None = None
        self.manifest = self._read_manifest()

    def _read_manifest(self) -> dict:
        try:
            data = json.loads(self.manifest_path.read_text())
            return data if isinstance(data, dict) and isinstance(data.get("users"), dict) else {"users": {}}
        except (OSError, ValueError):
            return {"users": {}}

    def clean_temporaries(self) -> int:
        """Remove temporary files a killed writer left behind (never complete documents)."""
        removed = 0
        if not self.directory.is_dir():
            return 0
        for path in self.directory.glob("*/.*.tmp"):
            path.unlink(missing_ok=True)
            removed += 1
        return removed

    def write(self, snapshot: Snapshot) -> WriteStats:
        start = time.perf_counter()
        cluster = snapshot.cluster
        stats = WriteStats(users=len(cluster.users))
        if self._cluster_hash is None or self._cluster_hash[0] != id(cluster):
            self._cluster_hash = (id(cluster), cluster_digest(cluster))
        digest = snapshot_digest(snapshot, self._cluster_hash[1] + "|" + ",".join(self.formats))
        if digest == self.manifest.get("digest") and self.directory.is_dir():
            stats.skipped_all, stats.unchanged = True, len(cluster.users)
            stats.seconds = time.perf_counter() - start
            return stats
        inbound_json = {r.inbound.id: r.inbound.model_dump_json() for r in cluster.inbounds}
        old: dict[str, list[str]] = self.manifest.get("users", {})
        new: dict[str, list[str]] = {}
        self.directory.mkdir(parents=True, exist_ok=True)
        for user in cluster.users:
            token = self.tokens.token(user.name, user.rotate)
            fp = user_fingerprint(snapshot, user.name, inbound_json)
            new[user.name] = [token, fp]
            if old.get(user.name) == [token, fp] and (self.directory / token).is_dir():
                stats.unchanged += 1
                continue
            self._write_user(snapshot, user.name, token)
            stats.written += 1
        live = {t for t, _ in new.values()}
        for token, _ in old.values():
            if token not in live:
                shutil.rmtree(self.directory / token, ignore_errors=True)
                stats.removed += 1
        self.manifest = {"digest": digest, "users": new}
        write_atomic(self.manifest_path, json.dumps(self.manifest).encode(), 0o600)
        stats.seconds = time.perf_counter() - start
        return stats

    def _write_user(self, snapshot: Snapshot, user: str, token: str) -> None:
        folder = self.directory / token
        folder.mkdir(exist_ok=True)
        headers: dict[str, dict[str, str]] = {}
        for fmt in self.formats:
            doc = render(snapshot, user, fmt, self.secret)
            _replace(folder / f"{fmt}.{EXTENSIONS[fmt]}", doc.body)
            headers[fmt] = doc.headers
        _replace(folder / "headers.json", json.dumps(headers, indent=1, ensure_ascii=False).encode())


def _replace(path: Path, data: bytes) -> None:
    """Write then rename (no fsync: a crash of this process cannot leave a part; power loss is the disk's business)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


class LiveAnswers:
    """Per-snapshot cache of rendered documents for the HTTP endpoint (same function as the files)."""

    def __init__(self, secret: Secret, tokens: Tokens):
        self.secret = secret
        self.tokens = tokens
        self.snapshot: Snapshot | None = None
        self._cache: dict[tuple[str, str, str | None], Document] = {}

    def publish(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self._cache = {}
        self.tokens.index(snapshot.cluster)

    def user_of(self, token: str) -> str | None:
        if self.snapshot is None:
            return None
        return self.tokens.index(self.snapshot.cluster).get(token)

    def answer(self, user: str, fmt: str, region: str | None = None) -> Document:
        assert self.snapshot is not None
        key = (user, fmt, region)
        doc = self._cache.get(key)
        if doc is None:
            doc = self._cache[key] = render(self.snapshot, user, fmt, self.secret, region=region)
        return doc
