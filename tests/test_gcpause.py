"""The cyclic collector paused around the interval's CPU work (reconciler.gcpause): back on when the last
pauser leaves, from any thread, and never switched on if it was off."""

from __future__ import annotations

import gc
import threading

from reconciler import gcpause


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


def test_a_reload_in_a_thread_never_turns_the_collector_on_under_an_interval(tmp_path, monkeypatch):
    # One collector, one pause. A reload (in a thread, as the loop reloads) validates with the collector paused; an
    # interval starts meanwhile and pauses it too; the reload ends first: the collector stays off until the interval
    # ends. (With a pause of its own, the reload's end turned it back on under the interval.)
    from pydantic import BaseModel

    from reconciler.config import load_cluster
    from reconciler.model import Cluster

    path = tmp_path / "cluster.yaml"
    path.write_text("servers:\n  - {name: a, host: 198.18.0.10, country: DE, inbounds: [{id: a-in, name: A, "
                    "protocol: shadowsocks-2022, port: 8388}]}\nusers:\n  - name: alice\n")
    validating, interval_started = threading.Event(), threading.Event()
    real = Cluster.model_validate.__func__  # type: ignore[attr-defined]

    def slow(cls: type[BaseModel], data: object, **kw: object) -> object:
        validating.set()
        assert interval_started.wait(10)
        return real(cls, data, **kw)

    monkeypatch.setattr(Cluster, "model_validate", classmethod(slow))
    loaded: list[bool] = []
    t = threading.Thread(target=lambda: loaded.append(load_cluster(str(path)).ok))
    assert gc.isenabled()
    t.start()
    assert validating.wait(10) and not gc.isenabled()
    with gcpause.paused():  # the interval
        interval_started.set()
        t.join(30)
        assert loaded == [True]
        assert not gc.isenabled()  # the reload is done; the interval is not
    assert gc.isenabled()
