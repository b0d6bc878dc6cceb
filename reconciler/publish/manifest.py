"""The manifest: what the file outlet published for each user (token, fingerprint, size), kept in the state
folder and read back, bounded, at start-up."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import numpy as np

from reconciler.credentials import TOKEN_CHARS
from reconciler.publish.digests import FINGERPRINT_CHARS

MANIFEST = "subscription-files.json"


#: The most the manifest may hold. A user's entry is ~96 bytes (``"user-123456": ["<token>", "<fingerprint>",
#: 12345], ``), 162 at most (a 63-character name, a 19-digit size): a million users' manifest is ~92 MiB, 155 MiB
#: at the longest; a bigger file is not one the loop wrote, and is not read (every user's files are written again).
MAX_MANIFEST_BYTES = 256 * 1024 * 1024


_FINGERPRINT = re.compile(rf"[0-9a-f]{{{FINGERPRINT_CHARS}}}")


def is_fingerprint(text: str) -> bool:
    """Whether ``text`` has the form of a user's fingerprint (``digests.fingerprint_of``: hex)."""
    return _FINGERPRINT.fullmatch(text) is not None


class Published(NamedTuple):
    """What the manifest records of one user's folder."""

    token: str
    fingerprint: str
    size: int  # bytes of all its files together


def empty_columns(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What was published of ``n`` users none of whom was: (tokens, fingerprints, sizes), ``PublishedTable``'s columns."""
    return np.zeros(n, f"S{TOKEN_CHARS}"), np.zeros(n, f"S{FINGERPRINT_CHARS}"), np.zeros(n, np.int64)


class PublishedTable(Mapping[str, Published]):
    """user → what was published of its files, as columns over a cluster's users (a dict of a million named tuples
    of two strings was ~370 MB), and a small dict beside for users the columns do not hold (who left the file).
    An empty token: nothing recorded for that user."""

    def __init__(self, names: tuple[str, ...], position: Mapping[str, int],
                 others: dict[str, Published] | None = None) -> None:
        self.names, self._at = names, position
        self.tokens, self.prints, self.sizes = empty_columns(len(names))
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

    def json_members(self, size: int) -> Iterator[bytes]:
        """The records as the members of the manifest's ``"users"`` object (``"name": ["token", "fingerprint", size]``,
        as ``json.dumps`` writes them), ``size`` users a piece. Tokens and fingerprints are what the outlet made or
        checked as it read them (``is_token``, ``is_fingerprint``): nothing in them to escape; only the names are
        (a dict a piece through ``json.dumps`` took 2.5 times as long: ~0.8 µs a user, at the end of every full pass)."""
        held = np.flatnonzero(self.tokens != b"")
        quote = json.encoder.encode_basestring_ascii  # (what ``json.dumps`` does to a string)
        for lo in range(0, len(held), size):
            at = held[lo:lo + size]
            rows = zip([quote(self.names[i]).encode() for i in at.tolist()], self.tokens[at].tolist(),
                       self.prints[at].tolist(), self.sizes[at].tolist(), strict=True)
            yield b", ".join([b'%s: ["%s", "%s", %d]' % row for row in rows])
        others = list(self.others.items())
        for lo in range(0, len(others), size):
            yield json.dumps({name: list(p) for name, p in others[lo:lo + size]})[1:-1].encode()

    def __len__(self) -> int:
        return int(np.count_nonzero(self.tokens != b"")) + len(self.others)
