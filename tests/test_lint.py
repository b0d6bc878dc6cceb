"""Style and layering are checked by tools, not by memory (STYLE.md)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

BIN = os.path.dirname(sys.executable)


def test_ruff_is_clean():
    targets = [d for d in ("reconciler", "tests", "bench") if (ROOT / d).is_dir()]
    out = subprocess.run([os.path.join(BIN, "ruff"), "check", *targets], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_import_layers_hold():
    out = subprocess.run([os.path.join(BIN, "lint-imports")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
