"""A big pass in worker processes: the snapshot spilled to the state folder (0600, HMAC'd under a key from the master
secret, never with the secret), each worker writing a slice of the users."""

from __future__ import annotations

from collections.abc import Callable
from typing import BinaryIO

import numpy as np

from reconciler.credentials import Secret
from reconciler.publish.manifest import PublishedTable
from reconciler.publish.userfiles import Before, Part, has_shadowsocks, write_users
from reconciler.state.files import Mac, mac_matches

SPILL_PREFIX = ".outlet-snapshot."  # the snapshot file of a pass in worker processes (state folder; see _in_workers)


def _spill_key(secret: Secret) -> bytes:
    """The HMAC key of a pass's snapshot file."""
    return secret.derive("outlet-snapshot-file")


class SpillMac(Mac):
    """The HMAC of a pass's snapshot file, keyed from the master secret (checked by ``mac_matches``)."""

    def __init__(self, secret: Secret) -> None:
        super().__init__(_spill_key(secret))


class Tee:
    """A writable file that also hands every piece written to ``also``."""

    def __init__(self, f: BinaryIO, also: Callable[[bytes], object]) -> None:
        self._f, self._also = f, also

    def write(self, data: bytes) -> int:
        self._also(data)
        return self._f.write(data)


def write_in_worker(spill: str, mac: str, secret: Secret, directory: str, formats: tuple[str, ...], before: Before,
            which: np.ndarray, headers_only: np.ndarray) -> Part:
    import pickle

    with open(spill, "rb") as f:
        data = f.read()
    if not mac_matches(_spill_key(secret), data, mac):  # not the file the pass wrote: never unpickled
        raise RuntimeError(f"the snapshot file {spill} is not the one this pass wrote")
    snapshot = pickle.loads(data)
    del data
    return write_users(snapshot, secret, directory, formats, before, which, headers_only, has_shadowsocks(snapshot))


def published_before(table: PublishedTable, which: np.ndarray) -> Before:
    return table.tokens[which], table.prints[which], table.sizes[which]
