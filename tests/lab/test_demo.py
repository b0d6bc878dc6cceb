"""What `make demo` runs, as a test: as root it boots sandbox servers of its own (one lab at a time on a machine),
so it lives with the lab tests and runs after all of them (``tests/lab/conftest.py`` orders it last)."""

from __future__ import annotations

import os
import shutil

from tests.conftest import EXAMPLE


def test_demo_shows_the_example(cli, tmp_path):
    # What `make demo` runs. As root (CI) it provisions sandbox servers, blocks one and watches it heal; it takes the
    # lab down first, so it runs after every other lab test (this folder's conftest puts it last).
    run = cli("demo", "-f", str(EXAMPLE), "--out-dir", str(tmp_path), "--scenario", "block", "--duration", "180")
    assert run.rc == 0, run.text
    if os.geteuid() == 0 and shutil.which("systemd-nspawn"):
        assert "→ unreachable after" in run.out and "→ ok after" in run.out, run.out[-3000:]
    assert "valid" in run.out and "Europe" in run.out and "empty — hidden" in run.out
    # The example downloads the official release; that it is not pinned yet is shown, and the demo goes on (issue 14).
    assert "not pinned by sha256" in run.err and "engine error" not in run.out
    assert (tmp_path / "topology.svg").read_text().startswith("<svg")
