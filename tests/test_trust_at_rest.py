"""Files the controller and its workers read back are hostile until checked: the live workers' snapshot and
the leader's published state are authenticated with an HMAC keyed from the master secret before anything is
made of them, the learned state and engine releases are bounded before they are inflated or allocated, and
the state folder is made private. Each test is one attack; none needs root, a network or a sandbox host."""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import io
import json
import logging
import multiprocessing
import os
import pickle
import stat
import tarfile
import threading
import tracemalloc
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reconciler.balance import Snapshot
from reconciler.config import load_cluster
from reconciler.errors import ReleaseError
from reconciler.fleet.learned import Learned, _npz, state_arrays
from reconciler.lab.demo import free_port
from reconciler.loop.leader import StateChannel, pack
from reconciler.loop.listener import Limits
from reconciler.loop.role import Elected
from reconciler.loop.workers import CLUSTER_FILE, SNAPSHOT_FILE, LiveWorkers, _Serving
from reconciler.model import Cluster
from reconciler.state.folder import FACTS, LEARNED, StateFolder
from tests.test_loop import SECRET, cluster
from tests.test_loop_faults import make_loop

MiB = 1 << 20


# --------------------------------------------------------------------------- the live workers' snapshot


class _Planted:
    """What an attacker pickles: unpickling it makes the folder ``marker`` (code of theirs running in a worker)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.mkdir, (self.marker,)


def _worker(tmp_path: Path) -> tuple[LiveWorkers, _Serving, Snapshot]:
    """The loop's side writing into ``tmp_path / state`` and one worker's side reading it, in this process."""
    c = cluster(3, users=5)
    snap = Snapshot(cluster=c, now=1e9)
    state = tmp_path / "state"
    pool = LiveWorkers(1, "127.0.0.1", 0, SECRET, state, str(tmp_path), lambda: (True, ""))
    state.mkdir(mode=0o700)
    pool.generation = pool._write(snap)
    parent, child = multiprocessing.Pipe()
    worker = _Serving(child, 0, SECRET, state, str(tmp_path), Limits(), True)
    worker._install(*worker._load())
    assert worker.generation == 1
    return pool, worker, snap


@pytest.mark.parametrize("swapped", [SNAPSHOT_FILE, CLUSTER_FILE])
def test_a_live_worker_never_unpickles_a_snapshot_file_it_did_not_get_from_the_loop(tmp_path, caplog, swapped):
    # Attack: someone who can write the state folder as the service's user swaps the snapshot (or cluster) file the
    # workers load for a pickle of their own (owner and mode as the loop writes them): unpickling it runs their code.
    pool, worker, snap = _worker(tmp_path)
    if swapped == CLUSTER_FILE:  # a new cluster: the next snapshot sends the workers to the cluster file too
        data = snap.cluster.model_dump(mode="json", exclude_defaults=True)
        data["users"].append({"name": "newbie"})
        pool.generation = pool._write(Snapshot(cluster=Cluster.model_validate(data), now=1e9 + 10))
    else:
        pool.generation = pool._write(snap)
    marker = tmp_path / "planted"
    target = pool.folder / swapped
    target.write_bytes(pickle.dumps((2, 2, _Planted(str(marker)))))
    os.chmod(target, 0o600)
    worker._wanted = 2
    with caplog.at_level(logging.ERROR, logger="reconciler.live"):
        asyncio.run(worker._load_wanted())
    assert not marker.exists(), "the worker unpickled a file the loop did not write"
    assert worker.generation == 1 and worker.answers.snapshot is not None  # still answering from what it had
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None, errors  # one clear line, no traceback
    assert str(target) in errors[0].getMessage() and "HMAC" in errors[0].getMessage()
    # The loop's next snapshot, its own, is taken again.
    pool.generation = pool._write(snap)
    worker._wanted = pool.generation
    asyncio.run(worker._load_wanted())
    assert worker.generation == pool.generation and not worker._load_error


@pytest.fixture(autouse=True)
def _unfrozen():  # type: ignore[no-untyped-def]
    """A worker's ``LiveAnswers.publish`` freezes the GC's view of the heap: this test process gets it back."""
    import gc

    yield
    gc.unfreeze()


# --------------------------------------------------------------------------- the learned state


def _npy_header(shape: tuple[int, ...], descr: str = "<f8") -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    return out.getvalue()


def _state_file(tmp_path: Path, data: bytes) -> StateFolder:
    folder = StateFolder(tmp_path / "st")
    folder.path.mkdir(mode=0o700, exist_ok=True)
    (folder.path / LEARNED).write_bytes(data)
    return folder


def _zip(members: dict[str, bytes], method: int = zipfile.ZIP_STORED) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", method) as zf:
        for name, body in members.items():
            zf.writestr(name, body)
    return out.getvalue()


@pytest.mark.parametrize("framed", [True, False], ids=["zstd frame", "zip"])
def test_a_learned_state_whose_array_header_declares_petabytes_is_a_named_fresh_start(tmp_path, framed):
    # Attack: a learned state whose .npy header declares 2**50 float64s in a member of a few bytes; reading it
    # allocated the whole declared array first (an uncaught MemoryError: the loop could not start).
    import zstandard

    c = cluster(2, users=3)
    good = state_arrays(Learned.fresh(c).to_bytes())
    members = {f"{k}.npy": _npy_bytes(v) for k, v in good.items()}
    members["rtt_ewma.npy"] = _npy_header((2**50,)) + b"\0" * 16
    data = _zip(members)
    if framed:
        data = zstandard.ZstdCompressor().compress(data)
    folder = _state_file(tmp_path, data)
    learned = folder.load_learned(c)
    assert learned.ticks == 0 and learned.rtt_ewma.shape == (2, 2)
    [note] = folder.notes
    assert str(folder.learned) in note and "rtt_ewma" in note and "declares" in note and "afresh" in note, note


def _npy_bytes(value: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, value, allow_pickle=False)
    return out.getvalue()


def _deflate_bomb(path: Path, members: dict[str, int]) -> None:
    """A zip (as states were written before: deflated) whose members inflate to that many MiB of float64 zeros."""
    zeros = bytes(MiB)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for name, mib in members.items():
            with zf.open(name, "w", force_zip64=True) as f:
                f.write(_npy_header((mib * MiB // 8,)))
                for _ in range(mib):
                    f.write(zeros)


def test_a_learned_state_inflating_to_770_mib_is_refused_before_it_is_inflated(tmp_path):
    # Attack: a zip bomb in the state folder: a ~770 KB learned.npz whose one array inflates to 770 MiB; reading it
    # inflated and allocated all of it (at every start of the loop and every `status`).
    folder = StateFolder(tmp_path / "st")
    folder.path.mkdir(mode=0o700)
    _deflate_bomb(folder.learned, {"rtt_ewma.npy": 770})
    assert folder.learned.stat().st_size < 2 * MiB
    tracemalloc.start()
    try:
        learned = folder.load_learned(cluster(2, users=3))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert learned.ticks == 0
    [note] = folder.notes
    assert str(folder.learned) in note and "inflates to" in note and "afresh" in note, note
    assert peak < 64 * MiB, f"{peak / MiB:.0f} MiB allocated reading a refused state"


def test_a_learned_state_whose_arrays_together_inflate_past_the_cap_is_refused(tmp_path, monkeypatch):
    # Attack: many members, each under the one-array cap, that together inflate past what a state may hold.
    import reconciler.fleet.learned as learned_module

    monkeypatch.setattr(learned_module, "MAX_STATE_BYTES", 8 * MiB, raising=False)
    monkeypatch.setattr(learned_module, "MAX_ARRAY_BYTES", 4 * MiB, raising=False)
    folder = StateFolder(tmp_path / "st")
    folder.path.mkdir(mode=0o700)
    _deflate_bomb(folder.learned, {f"x{i}.npy": 3 for i in range(4)})  # 4 × 3 MiB
    learned = folder.load_learned(cluster(2, users=3))
    [note] = folder.notes
    assert learned.ticks == 0 and "inflates to" in note and "a state may hold" in note, note


def _tampered(c: Cluster, **changes: np.ndarray) -> bytes:
    learned = Learned.fresh(c)
    learned.ticks = 5
    arrays = state_arrays(learned.to_bytes())
    arrays.update(changes)
    return _npz(arrays)


HOSTILE_ARRAYS = {
    "NaN in the engine's hazards": ("h_hazard", lambda n, m: np.full(n, np.nan)),
    "+inf in a capacity's time": ("cap_time", lambda n, m: np.full(n, np.inf)),
    "+inf in the RTT averages": ("rtt_ewma", lambda n, m: np.full((n, m), np.inf)),
    "NaN where -inf means never": ("h_last_report", lambda n, m: np.full(n, np.nan)),
    "RTTs of another shape": ("rtt_ewma", lambda n, m: np.zeros((1, 1))),
    "capacities one too many": ("cap_peak", lambda n, m: np.zeros(n + 1)),
    "the engine's streaks of another fleet": ("h_fail", lambda n, m: np.zeros((9, 9), np.int16)),
    "streaks as fractions": ("h_fail", lambda n, m: np.full((n, m), 0.5)),
    "complex hazards": ("h_hazard", lambda n, m: np.full(n, 1 + 1j)),
    "a country the fleet lacks": ("h_unreach_scope", lambda n, m: np.full(m, 40, np.int16)),
}


@pytest.mark.parametrize("case", HOSTILE_ARRAYS.values(), ids=HOSTILE_ARRAYS.keys())
def test_a_learned_state_with_arrays_the_fleet_cannot_have_is_a_named_fresh_start(tmp_path, case):
    # Attack: a well-formed learned state whose arrays are not finite, of another shape or of another kind than
    # its fleet (NaN hazards poison every verdict; RTTs of another shape made every later interval fail).
    name, make = case
    c = cluster(2, users=3)
    n, m = len(c.servers), len(c.inbounds)
    folder = _state_file(tmp_path, _tampered(c, **{name: make(n, m)}))
    learned = folder.load_learned(c)
    assert learned.ticks == 0, "the hostile state was taken"
    [note] = folder.notes
    assert str(folder.learned) in note and name in note and "afresh" in note, note
    learned.fold(c, {}, 1e9)  # and the fresh state works: the next interval does not fail
    learned.fold(c, {}, 1e9 + 10)


def test_a_learned_state_declaring_a_fleet_of_millions_is_a_named_fresh_start(tmp_path):
    # Attack: a learned state whose meta document declares two million servers (a few MB of JSON): the fleet's
    # (servers × servers) arrays were allocated from it — terabytes, an uncaught MemoryError at start.
    c = cluster(2, users=3)
    arrays = state_arrays(Learned.fresh(c).to_bytes())
    meta = json.loads(arrays["meta"].tobytes())
    n = 2_000_000
    meta |= {"servers": [f"s{i}" for i in range(n)], "countries": ["DE", "NL"] * (n // 2), "probers": [False] * n,
             "regions": [], "inbounds": ["s0-in"], "inbound_server": [0]}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    folder = _state_file(tmp_path, _zip({f"{k}.npy": _npy_bytes(v) for k, v in arrays.items()}))  # stored: ~40 MB
    learned = folder.load_learned(c)
    [note] = folder.notes
    assert learned.ticks == 0 and "2000000 servers" in note and "afresh" in note, note


def test_a_huge_learned_state_file_is_refused_unread(tmp_path):
    # Attack: a 600 MiB learned.npz in the state folder: it was read whole into memory before anything looked at it.
    c = cluster(2, users=3)
    folder = StateFolder(tmp_path / "st")
    folder.path.mkdir(mode=0o700)
    with open(folder.learned, "wb") as f:
        f.truncate(600 * MiB)  # sparse: no disk used
    learned = folder.load_learned(c)
    [note] = folder.notes
    assert learned.ticks == 0 and str(folder.learned) in note and "more than" in note, note


@pytest.mark.parametrize("name", [LEARNED, FACTS])
def test_a_fifo_in_place_of_a_state_file_does_not_block_the_start(tmp_path, name):
    # Attack: a FIFO named learned.npz (or facts.json) in the state folder: opening it blocked the loop's start, and
    # every apply, for ever.
    c = cluster(2, users=3)
    folder = StateFolder(tmp_path / "st")
    folder.path.mkdir(mode=0o700)
    os.mkfifo(folder.path / name, 0o600)
    done: list[object] = []
    reader = threading.Thread(daemon=True, target=lambda: done.append(
        StateFolder(folder.path).load_learned(c) if name == LEARNED else StateFolder(folder.path).facts()))
    reader.start()
    reader.join(10)
    if reader.is_alive():  # let the blocked open return, so that no thread is left behind
        os.close(os.open(folder.path / name, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail(f"reading {name} blocked on a FIFO")
    assert done


# --------------------------------------------------------------------------- the state the leader publishes


class FakeEtcd:
    """The part of etcd's API the state channel uses, over a dict; ``ranges`` counts the reads of each key."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.ranges: dict[str, int] = {}

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
            otherwise: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        for op in success:
            put = op.get("request_put")
            if put is not None:
                self.kv[base64.b64decode(put["key"]).decode()] = base64.b64decode(put["value"])
        return {"succeeded": True}

    def range(self, key: str, **options: Any) -> dict[str, Any]:
        self.ranges[key] = self.ranges.get(key, 0) + 1
        value = self.kv.get(key)
        kvs = [] if value is None else [{"value": base64.b64encode(value).decode()}]
        return {"header": {"revision": 1}, "kvs": kvs}


def _standby(tmp_path: Path) -> Any:
    """A controller of a cluster with standbys (its etcd: a ``FakeEtcd``), as a standby sees it."""
    path, port = tmp_path / "cluster.yaml", free_port()
    path.write_text(f'settings:\n  outputs: {{listen: "127.0.0.1:{port}"}}\n  leader: {{etcd: ["http://127.0.0.1:9"]}}\n'
                    "servers:\n"
                    "  - {name: a, host: 198.18.0.10, country: DE, inbounds: [{id: a-in, name: A, protocol: shadowsocks-2022, port: 8388}]}\n"
                    "  - {name: b, host: 198.18.0.11, country: DE, inbounds: [{id: b-in, name: B, protocol: shadowsocks-2022, port: 8388}]}\n"
                    "users:\n  - name: alice\n")
    loop = make_loop(str(path), port)  # not run: nothing listens, nothing reaches etcd
    assert isinstance(loop.role, Elected)
    loop.role.channel.etcd = FakeEtcd()  # type: ignore[assignment]
    return loop


def test_a_standby_refuses_a_learned_state_someone_without_the_secret_put_in_etcd(tmp_path, caplog):
    # Attack: someone who can write to etcd (but has not the master secret) publishes a learned state of their own
    # — with a right sha256 — and every standby served from it and took it over, managed servers and all.
    loop = _standby(tmp_path)
    assert isinstance(loop.role, Elected)
    etcd, prefix = loop.role.channel.etcd, loop.role.channel.prefix
    cluster_ = load_cluster(str(tmp_path / "cluster.yaml")).cluster
    assert cluster_ is not None
    forged = Learned.fresh(cluster_)
    forged.ticks = 999
    blob = pack(forged.to_bytes(), {"managed": {"evil": {"host": "203.0.113.66"}}})
    generation = "0000000000000099-0000000001"
    etcd.kv[f"{prefix}/state/g/{generation}/000000"] = blob
    pointer = {"by": "mallory", "generation": generation, "chunks": 1, "size": len(blob), "fence": 99,
               "sha256": hashlib.sha256(blob).hexdigest(), "hmac": "00" * 32, "at": 0}
    etcd.kv[f"{prefix}/state/current"] = json.dumps(pointer).encode()
    before = loop.learned
    with caplog.at_level(logging.WARNING, logger="reconciler"):
        for _ in range(3):
            assert asyncio.run(loop.role.follow()) is False
    assert loop.learned is before and loop.learned.ticks != 999  # it keeps what it had
    assert "evil" not in loop.state.managed()
    refused = [r for r in caplog.records if "HMAC" in r.getMessage()]
    assert len(refused) == 1, [r.getMessage() for r in caplog.records]  # one line, not one per interval
    # The leader's own publication, with the same master secret, is taken.
    loop.role.channel.publish_sync([], 100, pack(Learned.fresh(cluster_).to_bytes(), {}), {"by": "leader", "ticks": 0})
    assert asyncio.run(loop.role.follow()) is True


@pytest.mark.parametrize("declared", ["huge", "small"])
def test_a_published_state_is_bounded_before_its_chunks_are_read(declared):
    # Attack: a pointer in etcd that declares a state of a terabyte, or a small one with hundreds of 1 MiB chunks:
    # every chunk was read into memory before anything was checked.
    etcd = FakeEtcd()
    channel = StateChannel(etcd, "/p", SECRET)  # type: ignore[arg-type]
    n = 300
    for i in range(n):
        etcd.kv[f"/p/state/g/g1/{i:06d}"] = b"\0" * MiB
    size = 2**40 if declared == "huge" else 1000
    etcd.kv["/p/state/current"] = json.dumps({"generation": "g1", "chunks": n, "size": size, "hmac": "00" * 32}).encode()
    with pytest.raises(ValueError, match="refused"):
        channel.read_sync()
    chunk_reads = sum(v for k, v in etcd.ranges.items() if "/state/g/" in k)
    assert chunk_reads <= 1, chunk_reads


# --------------------------------------------------------------------------- engine releases


def _release(tmp_path: Path, data: bytes) -> tuple[str, str]:
    path = tmp_path / "release.download"
    path.write_bytes(data)
    return str(path), hashlib.sha256(data).hexdigest()


def _gzip_stream(pieces: Any) -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    return b"".join(z.compress(p) for p in pieces) + z.flush()


def _cache_bytes(tmp_path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in (tmp_path / "cache").rglob("*") if p.is_file())


def test_a_gzip_bomb_release_is_refused_while_it_inflates(tmp_path, monkeypatch):
    # Attack: the release at the engine's URL is a ~600 KB .gz that inflates to 600 MiB: unpacking it on the
    # controller (at `engine pin`, or to upload a binary) filled the cache's disk.
    from reconciler.engine import release

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    zeros = bytes(MiB)
    path, pin = _release(tmp_path, _gzip_stream(zeros for _ in range(600)))
    assert os.path.getsize(path) < 2 * MiB
    with pytest.raises(ReleaseError, match="inflates to more than"):
        release.fetch_binary("https://example.test/sing-box.gz", pin, "sing-box", fetched=path)
    assert _cache_bytes(tmp_path) < 16 * MiB  # nothing of it left behind


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, body in members:
            tar.addfile(info, io.BytesIO(body) if body is not None else None)
    return out.getvalue()


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    return info


@pytest.mark.parametrize("container", ["tar.gz", "tar.zst", "tar.bz2", "tar.xz", "zst", "tar of junk first"])
def test_a_release_bomb_is_refused_in_every_container(tmp_path, monkeypatch, container):
    # Attack: a release that inflates past the cap in each container the controller unpacks (here with the cap
    # lowered to 4 MiB and 16 MiB bombs, so the test stays small); it was unpacked whole.
    import bz2
    import lzma

    import zstandard

    from reconciler.engine import release

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(release, "MAX_UNPACKED_BYTES", 4 * MiB, raising=False)
    big = bytes(16 * MiB)
    tar = _tar([(_member("sing-box", len(big)), big)])
    if container == "tar of junk first":  # the binary is small; what comes before it is the bomb
        tar = _tar([(_member("junk", len(big)), big), (_member("sing-box", 10), b"0123456789")])
    data = {"tar.gz": lambda: gzip.compress(tar), "tar.zst": lambda: zstandard.ZstdCompressor().compress(tar),
            "tar.bz2": lambda: bz2.compress(tar), "tar.xz": lambda: lzma.compress(tar),
            "zst": lambda: zstandard.ZstdCompressor().compress(big),
            "tar of junk first": lambda: gzip.compress(tar)}[container]()
    path, pin = _release(tmp_path, data)
    with pytest.raises(ReleaseError, match="inflates to more than|more than the 4 MB an engine may be"):
        release.fetch_binary(f"https://example.test/sing-box.{container}", pin, "sing-box", fetched=path)


def _sparse_member(name: str, realsize: int) -> bytes:
    """A GNU sparse member (type ``S``) of ``realsize`` bytes, all hole but its last 512, which it stores."""
    info = tarfile.TarInfo(name)
    info.size = 512
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    header[156:157] = b"S"
    header[386:398] = b"%011o\0" % (realsize - 512)  # the one stored piece: its offset and length
    header[398:410] = b"%011o\0" % 512
    header[483:495] = b"%011o\0" % realsize
    header[148:156] = b" " * 8
    header[148:155] = b"%06o\0" % sum(header)
    return bytes(header) + b"x" * 512


def test_a_release_whose_binary_is_a_sparse_file_is_refused(tmp_path, monkeypatch):
    # Attack: the member named like the binary is a GNU sparse file declaring 600 MiB of holes in a 2 KB tar:
    # tarfile expands the holes outside any count of what is inflated.
    from reconciler.engine import release

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = _sparse_member("sing-box", 600 * MiB) + b"\0" * 1024
    assert next(iter(tarfile.open(fileobj=io.BytesIO(data)))).issparse()
    path, pin = _release(tmp_path, data)
    with pytest.raises(ReleaseError, match="not a regular file"):
        release.fetch_binary("https://example.test/sing-box.tar", pin, "sing-box", fetched=path)
    assert _cache_bytes(tmp_path) < 16 * MiB


# --------------------------------------------------------------------------- the state folder


@pytest.mark.parametrize("umask", [0o022, 0o277], ids=["umask 022 widens", "umask 277 narrows"])
def test_the_state_folder_and_the_folders_made_for_it_are_private(tmp_path, umask):
    # Attack: a state folder (and the folders made above it) readable by every local user under the usual umask
    # 022: the learned state (users, their traffic) and the outlet's snapshot files are listed and read by others.
    from reconciler.state.files import write_atomic

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    old = os.umask(umask)
    try:
        StateFolder(shared / "a" / "b" / "state").write_json("facts.json", {})
        with StateFolder(shared / "l1" / "l2").lock():
            pass
        write_atomic(shared / "w1" / "w2" / "file", b"x")
    finally:
        os.umask(old)
    for made in ("a", "a/b", "a/b/state", "l1", "l1/l2", "w1", "w1/w2"):
        assert stat.S_IMODE((shared / made).stat().st_mode) == 0o700, made
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755  # there before: not ours to change


# --------------------------------------------------------------------------- engine releases on the servers


def _header(name: str, size: int, kind: bytes = tarfile.REGTYPE, link: str = "") -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.linkname = size, kind, link
    return info.tobuf(tarfile.GNU_FORMAT)


def _zeros(n: int) -> Any:
    while n > 0:
        yield bytes(min(n, MiB))
        n -= MiB


_BINARY = b"\x7fELF" + b"\x01" * 60


def _server_bomb(kind: str) -> Any:
    """The pieces of a hostile tar stream (gzipped by the caller: a few MB)."""
    huge = 600 * MiB
    if kind == "junk members inflating to 600 MiB before the binary":  # each under the cap, together past it
        for i in range(6):
            yield _header(f"junk{i}", 100 * MiB)
            yield from _zeros(100 * MiB)
    elif kind == "the binary declaring 600 MiB":
        yield _header("usr/bin/sing-box", huge)
        yield from _zeros(huge)
    elif kind == "a 600 MiB pax header":  # tarfile reads a header's extended data whole, into memory
        yield _header("././@PaxHeader", huge, tarfile.XHDTYPE)
        yield from _zeros(huge)
    elif kind == "the binary as a 600 MiB sparse file":
        yield _sparse_member("sing-box", huge)
    elif kind == "the binary as a symlink":
        yield _header("sing-box", 0, tarfile.SYMTYPE, "/etc/shadow")
    else:
        raise AssertionError(kind)
    yield _header("sing-box", len(_BINARY)) + _BINARY + bytes(-len(_BINARY) % 512) + bytes(1024)


@pytest.mark.parametrize(("kind", "says"), [
    ("junk members inflating to 600 MiB before the binary", "the release inflates to more than 512 MB"),
    ("the binary declaring 600 MiB", "declares 629145600 bytes: the release inflates to more than 512 MB"),
    ("a 600 MiB pax header", "a tar header of the release holds more than 1 MB"),
    ("the binary as a 600 MiB sparse file", "sing-box is a sparse file, not a regular file"),
    ("the binary as a symlink", "sing-box is a link, not a regular file"),
])
def test_a_release_bomb_is_refused_by_the_servers_own_unpacking(tmp_path, kind, says):
    # Attack: a pinned release (the pin is whatever the attacker's URL served at `engine pin`) whose .tar.gz is a
    # few hundred KB and inflates to 600 MiB, or names a link or a sparse file as the binary. The server's engine
    # step (python3 -I -S, the request spliced in, as a server runs it) unpacked it without any bound: junk members
    # were inflated whole, the binary or its holes were written until the disk filled, a pax header was read into
    # memory. Here it runs under 256 MiB of address space and 64 MiB of file size: the cap must stop it first.
    import resource
    import subprocess
    import sys

    from reconciler.engine import remote
    from reconciler.engine.scripts.facts import zstd_library

    (tmp_path / "www").mkdir()
    (tmp_path / "server").mkdir()
    release = tmp_path / "www" / "sing-box.tar.gz"
    z = zlib.compressobj(1, zlib.DEFLATED, 31)  # fast: ~3 MB for 600 MiB
    release.write_bytes(b"".join(z.compress(p) for p in _server_bomb(kind)) + z.flush())
    assert release.stat().st_size < 4 * MiB
    tmp = tmp_path / "server" / "sing-box.reconciler-new"
    text, _ = remote.ENGINE.prepare({"tmp": str(tmp), "mode": "download", "url": release.as_uri(), "name": "sing-box",
                                     "sha256": hashlib.sha256(release.read_bytes()).hexdigest(), "version": "v",
                                     "library": zstd_library()})

    def limits() -> None:
        for which, soft in ((resource.RLIMIT_AS, 256 * MiB), (resource.RLIMIT_FSIZE, 64 * MiB)):
            resource.setrlimit(which, (soft, resource.getrlimit(which)[1]))

    out = subprocess.run([sys.executable, "-I", "-S", "-c", text], capture_output=True, text=True, timeout=120,
                         preexec_fn=limits)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["ok"] is False and answer["kind"] == "stage" and says in answer["error"], answer
    assert "refused" in answer["error"] and "MemoryError" not in answer["error"]
    assert not list((tmp_path / "server").iterdir())  # nothing staged, the download removed


def test_the_controller_and_the_servers_unpack_releases_with_one_cap():
    # The controller's unpacking is the servers' script, called with the same cap: one place decides.
    from reconciler.engine import release
    from reconciler.engine.scripts import engine as script

    assert release.MAX_UNPACKED_BYTES == script.MAX_UNPACKED_BYTES == 512 * MiB
    assert not hasattr(release, "_from_tar") and not hasattr(release, "unpack")


# --------------------------------------------------------------------------- the controller's own state files


def _peak_allocated(call: Any) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        return call(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_known_hosts_file_past_its_cap_is_refused_unread_and_said(tmp_path):
    # Attack: known_hosts.json grown past anything this controller writes (a valid document padded with 20 MiB of
    # whitespace; it could be gigabytes): it was read whole into memory and trusted.
    from reconciler.ssh import KnownHosts, Target
    from reconciler.ssh.pool import MAX_KNOWN_HOSTS_BYTES

    assert MAX_KNOWN_HOSTS_BYTES == 16 * MiB
    path = tmp_path / "known_hosts.json"
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHfakefakefakefakefakefakefakefakefakefakefake"
    with open(path, "wb") as f:
        f.write(json.dumps({"192.0.2.1:22": key}).encode())
        for _ in range(20):
            f.write(b" " * MiB)
    known, peak = _peak_allocated(lambda: KnownHosts(path))
    assert peak < 4 * MiB  # not read
    assert known.keys == {} and known.remembered(Target("a", "192.0.2.1")) is None
    assert str(path) in known.note and f"more than the {MAX_KNOWN_HOSTS_BYTES} allowed" in known.note, known.note
    assert "move the file aside" in known.note
    path.write_text(json.dumps({"192.0.2.1:22": key}))  # a file of the usual size is read as before
    assert KnownHosts(path).keys == {"192.0.2.1:22": key} and not KnownHosts(path).note


def test_a_manifest_past_its_cap_is_a_said_full_rewrite_not_a_crash(tmp_path, monkeypatch):
    # Attack: the outlet's manifest (subscription-files.json) grown past anything the loop writes: it was read
    # whole into memory at start-up. Here the cap is lowered to 64 KiB and a real manifest padded past it.
    from reconciler.fleet import Learned
    from reconciler.publish import MANIFEST, FileOutlet, files
    from tests.test_loop import snapshot_after

    c = cluster(3, users=6)
    snap = snapshot_after(c, Learned.fresh(c))
    assert FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET).write(snap).written == 6
    manifest = tmp_path / "state" / MANIFEST
    good = manifest.read_bytes()
    monkeypatch.setattr(files, "MAX_MANIFEST_BYTES", 64 * 1024, raising=False)
    manifest.write_bytes(good + b" " * (256 * 1024))  # still a valid manifest, every entry right
    outlet = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    assert outlet.published == {} and outlet.digest == ""  # as if absent
    assert any(str(manifest) in n and "more than the 65536 allowed" in n and "written again" in n
               for n in outlet.notes), outlet.notes
    stats = outlet.write(snap)
    assert stats.written == 6 and not stats.skipped_all  # a full rewrite
    outlet.close()
    assert json.loads(manifest.read_bytes()) == json.loads(good)  # and the manifest with it, back to its size


def test_the_manifest_cap_holds_a_million_users_with_room_to_spare(tmp_path):
    # The cap measured against what the loop writes: a million users with the longest names (63 characters) and
    # sizes of 19 digits must fit with half as much again to spare.
    from reconciler.publish import MANIFEST, FileOutlet, Published, PublishedTable
    from reconciler.publish.manifest import MAX_MANIFEST_BYTES

    outlet = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    users = {f"{i:06d}".ljust(63, "x"): Published("A" * 32, "f" * 32, 10 ** 18 + i) for i in range(2000)}
    outlet.published, outlet.digest = PublishedTable((), {}, users), "d" * 64
    outlet._write_manifest()
    per_user = (tmp_path / "state" / MANIFEST).stat().st_size / len(users)
    assert 1.5 * per_user * 1_000_000 < MAX_MANIFEST_BYTES <= 512 * MiB, per_user
    assert FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET).published.keys() == users.keys()


def test_the_servers_unpack_bzip2_and_xz_releases_through_the_same_counted_reader(tmp_path):
    # bzip2 and xz were tarfile's own (uncounted) stream reading; they are inflated block by block now, like gzip
    # and zstd: a good release still unpacks to its binary, and an upload is held to the cap too.
    import bz2
    import lzma

    from reconciler.engine.scripts import engine as script

    binary = os.urandom(300_000) + bytes(200_000)
    tar = _tar([(_member("LICENSE", 5), b"MIT\n\n"), (_member("sing-box-1.0/sing-box", len(binary)), binary)])
    digest = hashlib.sha256(binary).hexdigest()
    for what, data in {"tar.bz2": bz2.compress(tar), "tar.xz": lzma.compress(tar), "xz": lzma.compress(binary),
                       "bz2": bz2.compress(binary)}.items():
        archive, dest = tmp_path / f"release.{what}", tmp_path / f"out.{what}"
        archive.write_bytes(data)
        assert script.unpack(str(archive), str(dest), "sing-box") == digest, what
        assert dest.read_bytes() == binary, what
    archive.write_bytes(lzma.compress(tar)[:-40])
    with pytest.raises(RuntimeError, match="ended early|broken"):
        script.unpack(str(archive), str(tmp_path / "cut"), "sing-box")
    upload = io.BytesIO(_gzip_stream(bytes(MiB) for _ in range(8)))
    with pytest.raises(RuntimeError, match="the engine upload: it inflates to more than 4 MB"):
        script.write_blocks(script.Inflating(upload).chunk, str(tmp_path / "uploaded"), 4 * MiB)


def test_an_older_generation_in_etcd_is_a_replay_and_refused():
    # Attack: whoever can write to etcd puts back an authentic but older published state (last week's usage):
    # a standby that already read a newer one refuses it.
    etcd = FakeEtcd()
    channel = StateChannel(etcd, "/p", SECRET)  # type: ignore[arg-type]
    channel.publish_sync([], 5, b"new state", {"by": "leader"})
    older = dict(etcd.kv)
    channel.publish_sync([], 5, b"newer state", {"by": "leader"})
    assert channel.read_sync().blob == b"newer state"  # type: ignore[union-attr]
    etcd.kv.update(older)  # the older pointer and chunks, as they were
    with pytest.raises(ValueError, match="older"):
        channel.read_sync()
