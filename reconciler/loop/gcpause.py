"""The cyclic garbage collector paused around the interval's CPU work.

A million users' interval makes millions of short-lived tuples and dicts (reports, usage, standings, keys), none
of them in reference cycles: reference counting frees them. Each allocation burst still sets off the cyclic
collector, which walks the whole heap (the cluster's million users) again and again — measured at half of the
interval's CPU (bench/fleet_scale.py). ``paused()`` turns it off for a stretch of synchronous work and back on
after (nested and from several threads: it comes back on when the last one leaves, and only if it was on);
whatever cycles the stretch made are collected at the next collection after it.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = True


@contextmanager
def paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
