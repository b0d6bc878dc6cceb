"""What decides whether a user's files must be written again: the digest of a whole snapshot's inputs, each user's
fingerprint, and the usage step their ``subscription-userinfo`` follows."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np

from reconciler.balance import Snapshot, decide
from reconciler.balance.decide import Entry
from reconciler.model import Cluster, User, UserUsage
from reconciler.model.roster import ACTIVE, NO_LIMIT, STANDINGS

FINGERPRINT_CHARS = 32  # user_fingerprint: hex


STEP_HEX = 16  # a fingerprint's last characters are the usage step: a step alone is stamped without deciding again
# Documents are regenerated from the snapshot at will, so they are not fsynced one by one: the manifest,
# written durably after them, records each user's token, fingerprint and published size, and the sizes
# are checked at start-up (``verify``), so a document cut short (a full disk, a crash) is written again.


def cluster_digest(cluster: Cluster) -> str:
    return hashlib.sha256(cluster.model_dump_json().encode()).hexdigest()


def changed_users_digest(previous: str, changed: Mapping[str, User | None]) -> str:
    """The digest of a cluster made from one of digest ``previous`` by changing these users only (``with_users``):
    chained, so it costs the changed users, not a million. Two ways to the same users give two digests; that costs
    a rewrite of the documents, never a document left stale."""
    h = hashlib.sha256(previous.encode())
    for name in sorted(changed):
        user = changed[name]
        h.update(b"\0" + name.encode() + b"\0" + (user.model_dump_json().encode() if user is not None else b"-"))
    return h.hexdigest()


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
    h.update(usage_steps(roster.data_limit, roster.measured(snapshot.usage)[0]).tobytes())  # userinfo, in the users' order
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
    return 0 if used is None else int(usage_steps(np.array([limit], np.int64), np.array([used.used], np.int64))[0])


def usage_steps(limit: np.ndarray, used: np.ndarray) -> np.ndarray:
    """The usage step of each user (``usage_step``): bytes used over 100 MB, or over 1% of a limit under 10 GB."""
    step = np.where(limit > 0, np.clip(limit // 100, 1, USAGE_STEP), USAGE_STEP)
    steps: np.ndarray = used // step
    return steps


def user_fingerprint(snapshot: Snapshot, user_name: str, inbound_json: dict[str, str], outputs_json: str,
                     entries: list[Entry] | None = None, step: int | None = None) -> str:
    """What the user's documents depend on: the user, the output settings, their entries, those inbounds and keys,
    and the usage step (``step``: the caller's, from ``usage_steps`` over every user)."""
    entries = decide(snapshot, user_name) if entries is None else entries
    user = snapshot.cluster.user(user_name)
    return fingerprint_of(fingerprint_head(outputs_json, entries_text(snapshot, entries, inbound_json)),
                          user.model_dump_json(), usage_step(snapshot, user_name) if step is None else step)


def entries_text(snapshot: Snapshot, entries: list[Entry], inbound_json: dict[str, str]) -> str:
    """The entries' part of ``user_fingerprint``'s input (users with the same entries share it)."""
    return "".join(f"\n{e.route.id}\0{e.ref.inbound.id}\0{e.name}\0{inbound_json[e.ref.inbound.id]}"
                   f"\0{snapshot.public_keys.get(e.ref.inbound.id, '')}\0{snapshot.tls_pins.get(e.ref.inbound.id, '')}"
                   for e in entries)


def fingerprint_head(outputs_json: str, entries: str) -> hashlib._Hash:
    """What users with the same entries share of ``user_fingerprint``'s input, the output settings' JSON and
    ``entries_text`` (some kB), hashed once for all of them (``fingerprint_of`` hashes a copy on)."""
    return hashlib.sha256(f"{outputs_json}{entries}\n".encode())


def fingerprint_of(head: hashlib._Hash, user_json: str, step: int) -> str:
    """``user_fingerprint`` from its parts: ``fingerprint_head`` and the user's JSON (JSON: no line break in it)."""
    h = head.copy()
    h.update(user_json.encode())
    return h.hexdigest()[:FINGERPRINT_CHARS - STEP_HEX] + _step_hex(step)


def _step_hex(step: int) -> str:
    return f"{step & ((1 << 64) - 1):016x}"


def restepped(fingerprint: bytes, step: int) -> bytes:
    """The fingerprint of the same documents at another usage step (``user_fingerprint``'s last characters)."""
    return fingerprint[:FINGERPRINT_CHARS - STEP_HEX] + _step_hex(step).encode()
