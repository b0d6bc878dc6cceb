"""The cyclic collector paused around the interval's CPU work (reconciler.loop.gcpause): back on when the last
pauser leaves, from any thread, and never switched on if it was off."""

from __future__ import annotations

import gc
import threading

from reconciler.loop import gcpause


def test_paused_nests_across_threads_and_restores_what_it_found():
    assert gc.isenabled()
    entered, leave = threading.Event(), threading.Event()

    def other() -> None:
        with gcpause.paused():
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with gcpause.paused():
        assert not gc.isenabled()
        t.start()
        assert entered.wait(10)
        with gcpause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread still works with it paused
    leave.set()
    t.join(10)
    assert gc.isenabled()
    # An exception inside still turns it back on; a collector that was off stays off.
    try:
        with gcpause.paused():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert gc.isenabled()
    gc.disable()
    try:
        with gcpause.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
