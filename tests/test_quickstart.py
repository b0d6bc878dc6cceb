"""The README's quickstart, as a new operator runs it: its shell block, word for word, as an unprivileged user
(``nobody`` when the tests run as root) with a fresh home, in a copy of this checkout, into a clean virtualenv that
pip fills from the package index. Every command must succeed, and what they print must be what the README promises.
No network but the package index; no root; about 20 s (most of it pip)."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT

PATH = "/usr/local/bin:/usr/bin:/bin"


def quickstart_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart without root", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, "the README's quickstart has no sh block"
    return match.group(1)


def tracked_files() -> list[str]:
    """The checkout as a clone would have it (tracked files and new ones not ignored), not the venv or caches."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A folder in /tmp itself: pytest's own are root's alone, and the unprivileged user must reach this one."""
    path = Path(tempfile.mkdtemp(prefix="reconciler-quickstart-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_the_readme_quickstart_runs_unprivileged_from_a_clean_virtualenv(workdir):
    tmp_path = workdir
    block = quickstart_block()
    assert "sudo" not in block.replace("no sudo", "") and "make " not in block
    python = shutil.which("python3", path=PATH)
    if python is None:
        pytest.skip(f"no python3 on {PATH}")
    checkout, home = tmp_path / "checkout", tmp_path / "home"
    for f in tracked_files():
        (checkout / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, checkout / f)
    home.mkdir()
    prefix: list[str] = []
    if os.geteuid() == 0:  # as the tests run in CI: drop to nobody, who owns nothing but this home and checkout
        nobody = pwd.getpwnam("nobody")
        for path in (tmp_path, checkout, home, *checkout.rglob("*"), *home.rglob("*")):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        prefix = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]
    script = tmp_path / "quickstart.sh"
    script.write_text("set -eu\n" + block)
    env = {"HOME": str(home), "PATH": PATH, "LANG": "C.UTF-8", "PIP_CACHE_DIR": str(home / ".cache" / "pip"),
           **{k: v for k, v in os.environ.items() if k.startswith("PIP_")}}
    run = subprocess.run([*prefix, "sh", "-x", str(script)], cwd=checkout, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out, err = run.stdout, run.stderr
    cluster = home / "vpn" / "cluster.yaml"
    assert cluster.exists() and sorted(p.name for p in cluster.parent.iterdir()) == ["cluster.yaml"]  # one file, no more
    assert "valid — 1 server, 1 inbound, 1 route (0 empty), 1 user" in out + err and "placeholder" in err
    assert "verdict timeline" in out and "unreachable from RU" in out, out[-2000:]  # the simulated censor seen
    assert re.search(r"^proxies:\n  - \{name: .*reality-opts: \{public-key: ", out, re.M), out[-2000:]
    assert re.search(r"^http://127\.0\.0\.1:8080/sub/[A-Za-z0-9_-]{20,}$", out, re.M) and "█" in out
    # The installed package carries every file it reads at run time: the console's templates and catalogs too.
    venv_python = home / ".venvs" / "reconciler" / "bin" / "python"
    check = subprocess.run([*prefix, str(venv_python), "-c", "from reconciler.console.render import _environment, catalog; "
                            "[_environment().get_template(t) for t in ('fleet.html', 'server.html', 'user.html')]; "
                            "print(catalog('ru')['console'])"], cwd=home, env=env, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and check.stdout.strip() == "Консоль", check.stderr[-2000:]
