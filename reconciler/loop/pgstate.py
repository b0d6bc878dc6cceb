"""The learned state handed between controllers through the users' PostgreSQL instead of etcd (with
``settings.users.source: postgres``): etcd keeps the election, its lease and the fence; the state itself (tens of
megabytes at a million users: the usage ledger, the assignments, the books) is one row, written by the leader once
per interval in one transaction and read by a standby, under the same HMAC as in etcd (the database is trusted
with nothing the master secret does not sign). A deposed leader's write carries an older fence and writes nothing,
so a takeover keeps every counter: at most the old leader's last interval is lost, never counted twice.
"""

from __future__ import annotations

import time
from typing import Any

from reconciler.credentials import Secret
from reconciler.loop.leader import MAX_PUBLISHED_BYTES, ChannelBase, Published, generation_order
from reconciler.state.files import mac_matches
from reconciler.userdb import UserDatabase


class PgStateChannel(ChannelBase):
    """``StateChannel``'s interface over ``UserDatabase.put_state``/``get_state``; ``guard`` is etcd's and unused
    here: the fence guards the row."""

    def __init__(self, db: UserDatabase, secret: Secret):
        super().__init__(secret, "pg-state")
        self.db = db

    def publish_sync(self, guard: list[dict[str, Any]], fence: int, blob: bytes, meta: dict[str, Any]) -> str | None:
        generation, mac = self._next_generation(fence, blob)
        pointer = {**meta, "generation": generation, "size": len(blob), "fence": fence, "hmac": mac,
                   "at": time.time(), "store": "postgres"}
        return generation if self.db.put_state(generation, fence, pointer, blob) else None

    def read_sync(self, known: str | None = None) -> Published | None:
        got = self.db.get_state(known, MAX_PUBLISHED_BYTES)
        if got is None:
            return None
        pointer, blob = got
        generation, mac = str(pointer.get("generation")), pointer.get("hmac")
        if self._newest is not None and generation_order(generation) < generation_order(self._newest):
            raise ValueError(f"the learned state {generation} is older than {self._newest}, which this controller "
                             "already read (an old row written back?): refused")
        if not isinstance(mac, str) or pointer.get("size") != len(blob) \
                or not mac_matches(self._generation_key(generation), blob, mac):
            raise ValueError(f"the learned state {generation} in the {self.db.name}: its HMAC does not match (not "
                             "written by a controller with this master secret): refused; this controller keeps its own")
        self._newest = generation
        return Published(pointer, blob)
