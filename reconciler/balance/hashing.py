"""Rendezvous (highest-random-weight) hashing, vectorised (LB-6, LB-9).

Every (user, inbound) pair gets a fixed pseudo-random U in (0, 1); a user picks
the candidate with the largest ``d / -ln U``, where ``d`` is the candidate's
desirability. Over many users each candidate's share is proportional to ``d``
(the policy's proportions, no herding), and a user's pick changes only when
the desirabilities change enough to reorder *that user's* scores — as in
Envoy's and mcrouter's weighted rendezvous hashing.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def key64(text: str) -> int:
    """A stable 64-bit key of a name (users, inbounds, routes)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def keys64(texts: list[str]) -> np.ndarray:
    return np.array([key64(t) for t in texts], dtype=np.uint64)


@functools.lru_cache(maxsize=4)
def name_keys(names: tuple[str, ...]) -> np.ndarray:
    """``key64`` of every name, computed once per set of names (a cluster's users), not once per interval. Read only."""
    keys = np.fromiter((key64(t) for t in names), np.uint64, len(names))
    keys.flags.writeable = False
    return keys


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a full-avalanche 64-bit mix (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        mixed: np.ndarray = x ^ (x >> np.uint64(31))
        return mixed


def exponentials(users: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """-ln U for every (user, candidate): an (U, K) array of Exp(1) draws fixed by the keys."""
    with np.errstate(over="ignore"):
        x = _mix(users[:, None] * _GOLD ^ candidates[None, :])
    u = ((x >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)
    return -np.log(u)


def scores(users: np.ndarray, candidates: np.ndarray, desirability: np.ndarray) -> np.ndarray:
    """HRW scores d / -ln U, (U, K)."""
    result: np.ndarray = desirability[None, :] / exponentials(users, candidates)
    return result
