"""The learned state handed between controllers through the users' PostgreSQL instead of etcd (with
``settings.users.source: postgres``): etcd keeps the election, its lease and the fence; the state itself (tens of
megabytes at a million users: the usage ledger, the assignments, the books) is one row, written by the leader once
per interval in one transaction and read by a standby, under the same HMAC as in etcd (the database is trusted
with nothing the master secret does not sign). A deposed leader's write carries an older fence and writes nothing,
so a takeover keeps every counter: at most the old leader's last interval is lost, never counted twice.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from reconciler.credentials import Secret
from reconciler.loop.leader import MAX_PUBLISHED_BYTES, Published, generation_order
from reconciler.state.files import Mac, mac_matches
from reconciler.userdb import UserDatabase


class PgStateChannel:
    """``StateChannel``'s interface over ``UserDatabase.put_state``/``get_state``; ``guard`` is etcd's and unused
    here: the fence guards the row."""

    def __init__(self, db: UserDatabase, secret: Secret):
        self.db = db
        self._key = secret.derive("published-learned-state")
        self._seq = 0
        self._newest: str | None = None  # the newest generation read: an older one is a replay, refused
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pg-state")

    def _generation_key(self, generation: str) -> bytes:
        return hmac.digest(self._key, generation.encode(), "sha256")

    def publish_sync(self, guard: list[dict[str, Any]], fence: int, blob: bytes, meta: dict[str, Any]) -> str | None:
        if len(blob) > MAX_PUBLISHED_BYTES:
            raise ValueError(f"the learned state is {len(blob)} bytes, more than the {MAX_PUBLISHED_BYTES} a standby "
                             "reads: not published")
        self._seq += 1
        generation = f"{fence:016d}-{self._seq:010d}"
        mac = Mac(self._generation_key(generation))
        mac.update(blob)
        pointer = {**meta, "generation": generation, "size": len(blob), "fence": fence, "hmac": mac.hexdigest(),
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

    async def publish(self, guard: list[dict[str, Any]], fence: int, blob: bytes, meta: dict[str, Any]) -> str | None:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.publish_sync, guard, fence, blob, meta)

    async def read(self, known: str | None = None) -> Published | None:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.read_sync, known)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
