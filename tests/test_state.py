"""The state folder is hostile input too (it may be committed, copied, cut by a full disk): every
file that cannot be read is a named fresh start, never an exception; writes are atomic and private;
its lock keeps two writers apart."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest

from reconciler.errors import LockHeld
from reconciler.ssh import KnownHosts
from reconciler.state.files import write_atomic
from reconciler.state.folder import FACTS, KNOWN_HOSTS, MANAGED, StateFolder
from tests.test_loop import cluster

CORRUPT = {
    "garbage bytes": b"\x00\xff\xfe garbage",
    "empty": b"",
    "a JSON array": b"[1, 2, 3]",
    "a JSON string": b'"hello"',
    "cut short": b'{"public_keys": {"a": "b"',
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "not UTF-8": b'{"a": "\xff\xfe"}',
    "wrong value types": json.dumps({"public_keys": ["x"], "tls_pins": {"a": 1}, "s1": 5}).encode(),
    "NaN": b'{"public_keys": {"a": NaN}}',
}


@pytest.mark.parametrize("data", CORRUPT.values(), ids=CORRUPT.keys())
def test_a_corrupt_state_file_is_a_named_fresh_start(tmp_path, data):
    for name in (FACTS, MANAGED, KNOWN_HOSTS):
        (tmp_path / name).write_bytes(data)
    state = StateFolder(tmp_path)
    facts = state.facts()
    assert set(facts) == {"public_keys", "tls_pins"}
    assert all(isinstance(v, str) for kind in facts.values() for v in kind.values())
    managed = state.managed()
    assert all(isinstance(v, dict) for v in managed.values())
    known = KnownHosts(tmp_path / KNOWN_HOSTS)
    assert all(isinstance(v, str) for v in known.keys.values())
    assert state.notes and all(str(tmp_path) in n for n in state.notes)  # named, never silent


def test_writes_are_atomic_private_and_leave_no_temporary_files(tmp_path):
    state = StateFolder(tmp_path / "st")
    state.write_json(FACTS, {"public_keys": {"a": "k"}})
    state.remember_facts({"public_keys": {"b": "k2"}, "tls_pins": {}})
    assert state.facts()["public_keys"] == {"a": "k", "b": "k2"}
    assert oct((tmp_path / "st").stat().st_mode & 0o777) == "0o700"
    assert oct((tmp_path / "st" / FACTS).stat().st_mode & 0o777) == "0o600"
    assert sorted(os.listdir(tmp_path / "st")) == [FACTS]
    write_atomic(tmp_path / "x", b"a" * 1_000_000)
    assert (tmp_path / "x").read_bytes() == b"a" * 1_000_000 and sorted(os.listdir(tmp_path)) == ["st", "x"]


def test_a_failed_write_leaves_the_old_content_and_no_temporary(tmp_path):
    (tmp_path / "f").write_bytes(b"old")

    class Boom(Exception):
        pass

    import reconciler.state.files as files

    real = files.os.replace

    def fail(*_args: object) -> None:
        raise Boom

    files.os.replace = fail  # type: ignore[assignment]
    try:
        with pytest.raises(Boom):
            write_atomic(tmp_path / "f", b"new")
    finally:
        files.os.replace = real
    assert (tmp_path / "f").read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["f"]


def _hold(path: str, ready: multiprocessing.synchronize.Event, done: multiprocessing.synchronize.Event) -> None:
    with StateFolder(__import__("pathlib").Path(path)).lock("apply"):
        ready.set()
        done.wait(20)


def test_the_folder_lock_keeps_a_second_writer_out_and_names_the_holder(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), ready, done))
    holder.start()
    try:
        assert ready.wait(20)
        with pytest.raises(LockHeld, match=f"apply \\(pid {holder.pid}\\)"), StateFolder(tmp_path).lock("run"):
            pass
    finally:
        done.set()
        holder.join(20)
    with StateFolder(tmp_path).lock("apply"):  # free again once the holder is gone
        pass


def test_learned_state_of_another_cluster_is_adopted_not_trusted(tmp_path):
    state = StateFolder(tmp_path)
    from reconciler.fleet import Learned

    state.save_learned(Learned.fresh(cluster(5)))
    smaller = cluster(2)
    learned = state.load_learned(smaller)
    assert learned.topology.servers == ("s0", "s1") and not state.notes


def test_apply_refuses_while_another_apply_holds_the_state_folder(tmp_path, cli, monkeypatch):
    monkeypatch.setenv("RECONCILER_SECRET", "state-lock-test-secret-0123456789abcdef")
    path = tmp_path / "cluster.yaml"
    path.write_text("users:\n  - name: alice\n")  # no servers: nothing to reach, only the folder's lock to take
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path / ".reconciler"), ready, done))
    holder.start()
    try:
        assert ready.wait(20)
        run = cli("apply", "-f", str(path))
        assert run.rc == 1 and f"in use by apply (pid {holder.pid})" in run.err and "try again later" in run.err, run.text
    finally:
        done.set()
        holder.join(20)
    run = cli("apply", "-f", str(path))
    assert run.rc == 0, run.text
