"""One lab at a time on a machine: every lab names its hosts, bridge and blocking table alike, so a second lab
refuses with a clear message instead of tearing into the first, and a lab that died is cleaned up by the next."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from reconciler.lab import Lab
from tests.lab.conftest import ssh


def _reconciler(lab_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "reconciler")
    env = {**os.environ, "RECONCILER_LAB_DIR": str(lab_dir)}
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, env=env, cwd=lab_dir.parent)


def test_a_second_lab_is_refused_and_the_first_keeps_running(lab, tmp_path):
    # Another checkout (its own lab folder) while this session's lab runs: refused before it creates anything.
    other = tmp_path / "elsewhere" / ".lab"
    other.mkdir(parents=True)
    up = _reconciler(other, "lab", "up", "--hosts", "1", "--write", str(tmp_path / "c.yaml"))
    assert up.returncode == 1, up.stdout + up.stderr
    assert "another lab is running on this machine (vps1" in up.stderr and "one lab at a time" in up.stderr
    assert str(Path(lab.state.hosts[0].dir).parent) in up.stderr  # where the running one lives
    assert "Traceback" not in up.stderr and not (tmp_path / "c.yaml").exists()
    # Its `down` removes nothing of the running lab, not even the shared bridge.
    down = _reconciler(other, "lab", "down")
    assert down.returncode == 0, down.stderr
    assert Path("/sys/class/net/rlabbr0").exists()
    # The same folder from another process: the lab is in use by this one.
    same = _reconciler(lab.root, "lab", "down")
    assert same.returncode == 1 and f"the lab in {lab.root} is in use by process {os.getpid()}" in same.stderr
    for host in lab.state.hosts:
        assert ssh(lab, host, "true").returncode == 0, host.name


def test_what_a_dead_lab_left_is_removed_by_the_next(lab, tmp_path):
    # A run killed before it cleaned up leaves namespaces and cgroups with the lab's names, and nothing runs in them
    # ("ip netns add rlab1: File exists" for the next lab otherwise). Removed; the running lab's hosts are not.
    subprocess.run(["ip", "netns", "add", "rlab97"], check=True)
    cgroup = Path("/sys/fs/cgroup/unified/reconciler-lab/vps97")
    if Path("/sys/fs/cgroup/unified/reconciler-lab").is_dir():
        cgroup.mkdir(exist_ok=True)
    messages: list[str] = []
    try:
        Lab(root=tmp_path / "elsewhere", log=messages.append).down()
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "rlab97" not in names and not cgroup.exists()
        assert messages == ["removing vps97, left over by a lab that did not clean up"]
        assert all(host.netns in names for host in lab.state.hosts)
    finally:
        subprocess.run(["ip", "netns", "del", "rlab97"], capture_output=True)
