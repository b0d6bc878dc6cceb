"""The cyclic garbage collector: the one place that pauses it, and freezes what lives on.

Loading a million users' file, validating it, and an interval's CPU work make millions of objects that live on or
are freed by reference counting, none in reference cycles worth a walk; each allocation burst still sets off the
cyclic collector, which walks the whole heap again and again (measured: 10 s of a 15 s load of 100,000 users; half
of a million users' interval, ``bench/fleet_scale.py``). ``paused()`` turns it off for a stretch of work and back
on after. There is one collector per process, so there is one pause: stretches nest, in any thread (a reload in a
thread while an interval runs), and the collector comes back on when the last one leaves, and only if it was on
when the first came. A child forked during a pause is not in that stretch: it gets its collector back.

``freeze_survivors()`` moves what is alive now out of the collector's sight (``gc.freeze``: a published snapshot
that lives until the next); ``thaw_and_collect()`` gives it back and collects, now and then, so that cycles frozen
with it are freed.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class _Pause:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.was_enabled = False

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self.lock:
            if self.holders == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
            self.holders += 1
        try:
            yield
        finally:
            with self.lock:
                if self.holders:  # (0 in a child forked during this stretch: ``forked`` ended the pause)
                    self.holders -= 1
                    if self.holders == 0 and self.was_enabled:
                        gc.enable()

    def forked(self) -> None:
        """In a child forked while a thread was paused: that stretch is not the child's, so neither is its pause."""
        self.lock = threading.Lock()
        if self.holders and self.was_enabled:
            gc.enable()
        self.holders = 0


paused = _Pause()
os.register_at_fork(after_in_child=paused.forked)


def freeze_survivors(collect_young: bool = True) -> None:
    """What is alive now leaves the collector's sight (after the young generations are collected, so that little
    garbage is frozen with it)."""
    if collect_young:
        gc.collect(1)
    gc.freeze()


def thaw_and_collect() -> None:
    """Everything frozen comes back into the collector's sight, and one full collection frees its cycles."""
    gc.unfreeze()
    gc.collect()
