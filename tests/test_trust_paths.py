"""The cluster file may name only files in its repository, or in folders the operator allows outside the file.

The cluster file is what a pull request edits, by someone who must not read the controller's disk. Each test
below is an attack of such a request (or the operator's way to allow a folder): a TLS key that names a file of
the controller (which `apply` would upload to a server the request also names), an include or an engine binary
that leads out of the repository, and ``settings.include_roots``, with which the file lifted its own confinement.
``validate`` names the line of the value and what to do; ``plan`` and ``apply`` refuse the same; the reader
checks again what it opens (a symlink swapped in after validation).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from reconciler.config import load_cluster
from reconciler.credentials import Secret
from reconciler.engine.adapters import adapter_of
from reconciler.engine.base import tls_files
from tests.conftest import capable_example_text, plant

SECRET_TEXT = "-----BEGIN OPENSSH PRIVATE KEY-----\nthe-controllers-own-ssh-key\n-----END OPENSSH PRIVATE KEY-----\n"
KEY_LINE = "          key: certs/ber-1.key"
SECRET = Secret(b"trust-paths-test-secret-0123456789abc")
ALLOW_WORDS = ("--allow-path", "RECONCILER_ALLOW_PATHS", "move the file into")


@pytest.fixture(autouse=True)
def _no_allowance(monkeypatch):
    monkeypatch.delenv("RECONCILER_ALLOW_PATHS", raising=False)


def _layout(tmp_path: Path, key: str | None = None) -> tuple[Path, Path, int, int]:
    """tmp/repo/cluster.yaml (the example, its TLS pair in repo/certs) and tmp/private/id_ed25519, a file of the
    controller outside the repository. Returns (cluster file, that file, line and column of tls.key's value)."""
    repo, private = tmp_path / "repo", tmp_path / "private"
    (repo / "certs").mkdir(parents=True)
    private.mkdir()
    (private / "id_ed25519").write_text(SECRET_TEXT)
    (repo / "certs" / "ber-1.pem").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    (repo / "certs" / "ber-1.key").write_text("-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n")
    example = capable_example_text().replace(  # the example's commented pair, set
        "          # certificate: certs/ber-1.pem", "          certificate: certs/ber-1.pem  #").replace(
        "          # key: certs/ber-1.key           #", KEY_LINE + "  #")
    text, line = plant(example, KEY_LINE, f"          key: {key}" if key else KEY_LINE)
    (repo / "cluster.yaml").write_text(text)
    return repo / "cluster.yaml", private / "id_ed25519", line, len("          key: ") + 1


def _refused_at(run, path: Path, line: int, col: int, says: str) -> None:
    assert run.rc == 1, run.text
    assert "Traceback" not in run.text and "internal error" not in run.text
    assert re.search(rf"^{re.escape(str(path))}:{line}:{col}: error: .*{says}", run.err, re.M), run.err
    assert all(word in run.err for word in ALLOW_WORDS), run.err
    assert "the-controllers-own-ssh-key" not in run.text  # the refusal never shows the file


def test_a_tls_key_outside_the_repository_is_refused_at_its_line(cli, tmp_path):
    # Attack: `key: /root/.ssh/id_ed25519` — apply would upload the controller's SSH key to the request's server.
    outside = tmp_path / "private" / "id_ed25519"
    path, _, line, col = _layout(tmp_path, key=str(outside))
    _refused_at(cli("validate", str(path)), path, line, col, "tls.key of inbound 'ber-1-trojan' names .* outside the cluster's folder")


def test_a_tls_key_escaping_by_dot_dot_is_refused(cli, tmp_path):
    # Attack: `key: ../private/id_ed25519` — a relative path that climbs out of the repository.
    path, _, line, col = _layout(tmp_path, key="../private/id_ed25519")
    _refused_at(cli("validate", str(path)), path, line, col, "names '../private/id_ed25519', which is outside")


def test_a_symlink_in_the_repository_to_a_file_outside_is_refused(cli, tmp_path):
    # Attack: the request adds `certs/ber-1.key` as a symlink to the controller's key; the value looks innocent.
    path, secret, line, col = _layout(tmp_path)
    key = path.parent / "certs" / "ber-1.key"
    key.unlink()
    key.symlink_to(os.path.relpath(secret, key.parent))
    _refused_at(cli("validate", str(path)), path, line, col, "leads through a symlink outside")


def test_plan_and_apply_refuse_what_validate_refuses(cli, tmp_path, monkeypatch):
    # Attack: skip validate and go straight to apply; both load the file the same way, before any server is touched.
    monkeypatch.delenv("RECONCILER_SECRET", raising=False)  # and without a secret no server could be touched anyway
    outside = tmp_path / "private" / "id_ed25519"
    path, _, line, col = _layout(tmp_path, key=str(outside))
    for command in (("plan", "-f", str(path)), ("apply", "-f", str(path), "--auto-approve")):
        _refused_at(cli(*command), path, line, col, "outside the cluster's folder")


@pytest.mark.parametrize("field,old,new", [
    # Attack: any file of the controller uploaded as the "engine binary" (and run for its version by validate).
    ("binary", "    install: download", "    install: upload\n    binary: {outside}"),
    # Attack: the etcd password file is sent to the etcd the file names: any file of the controller would be.
    ("password_file", "  self_heal: true", "  leader: {{etcd: ['http://192.0.2.9:2379'], username: u, "
                                           "password_file: {outside}}}\n  self_heal: true"),
], ids=["engine-binary", "etcd-password-file"])
def test_other_files_the_controller_sends_are_confined_too(cli, tmp_path, field, old, new):
    path, secret, _, _ = _layout(tmp_path)
    text, line = plant(path.read_text(), old, new.format(outside=secret))
    path.write_text(text)
    run = cli("validate", str(path))
    assert run.rc == 1, run.text
    errors = [e for e in run.err.splitlines() if "error:" in e and field in e]
    assert errors and "outside the cluster's folder" in errors[0], run.err
    assert errors[0].startswith(f"{path}:{line + (1 if field == 'binary' else 0)}:"), run.err


def test_include_roots_in_the_file_is_refused(cli, tmp_path):
    # Attack: the file lifts its own confinement (`include_roots: [/]`) and includes a file of the controller.
    path, _, _, _ = _layout(tmp_path)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "team.yaml").write_text("users: [{name: mallory}]\n")
    text, _ = plant(path.read_text(), "# includes: [users.d/*.yaml]", "includes: [../shared/team.yaml]")
    text, line = plant(text, "  self_heal: true", "  include_roots: [../shared]\n  self_heal: true")
    path.write_text(text)
    run = cli("validate", str(path))
    assert run.rc == 1, run.text
    assert f"{path}:{line}:3: error: settings.include_roots is no longer read from the cluster file" in run.err, run.err
    assert "a pull request could edit it" in run.err and "--allow-path" in run.err and "RECONCILER_ALLOW_PATHS" in run.err
    assert "reaches outside the cluster's folder" in run.err  # and it allowed nothing
    assert "unknown key" not in run.err  # one clear error, not a second one from the schema


def test_an_include_escaping_the_repository_is_refused(cli, tmp_path):
    # Attack: an include that climbs out (or a symlinked include) reads a file of the controller into the cluster.
    path, _, _, _ = _layout(tmp_path)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "team.yaml").write_text("users: [{name: mallory}]\n")
    (path.parent / "team.yaml").symlink_to(tmp_path / "shared" / "team.yaml")
    for include in ("../shared/team.yaml", "team.yaml"):
        text, line = plant(capable_example_text(), "# includes: [users.d/*.yaml]", f"includes: [{include}]")
        path.write_text(text)
        run = cli("validate", str(path))
        assert run.rc == 1, run.text
        assert f"{path}:{line}:" in run.err and "reaches outside the cluster's folder" in run.err, run.err
        assert "--allow-path" in run.err and "mallory" not in run.text


def test_the_environment_variable_allows_a_folder(cli, tmp_path, monkeypatch):
    # The operator, not the file, allows the folder: RECONCILER_ALLOW_PATHS (os.pathsep-separated).
    path, secret, _, _ = _layout(tmp_path, key=str(tmp_path / "private" / "id_ed25519"))
    monkeypatch.setenv("RECONCILER_ALLOW_PATHS", os.pathsep.join(["/nonexistent-folder", str(secret.parent)]))
    run = cli("validate", str(path))
    assert run.rc == 0, run.text


def test_the_command_line_option_allows_a_folder_for_that_command_only(cli, tmp_path):
    # The operator's --allow-path (repeatable); the next command without it is refused again.
    path, secret, line, col = _layout(tmp_path, key="../private/id_ed25519")
    run = cli("validate", str(path), "--allow-path", str(tmp_path / "elsewhere"), "--allow-path", str(secret.parent))
    assert run.rc == 0, run.text
    _refused_at(cli("validate", str(path)), path, line, col, "outside the cluster's folder")


def test_an_allowed_include_folder(cli, tmp_path, monkeypatch):
    path, _, _, _ = _layout(tmp_path)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "team.yaml").write_text("users: [{name: erin}]\n")
    text, _ = plant(capable_example_text(), "# includes: [users.d/*.yaml]", "includes: [../shared/team.yaml]")
    path.write_text(text)
    monkeypatch.setenv("RECONCILER_ALLOW_PATHS", str(tmp_path / "shared"))
    run = cli("validate", str(path), "--json")
    assert run.rc == 0, run.text
    assert '"users": 5' in run.out


def _ber_1(path: Path):
    result = load_cluster(str(path))
    assert result.cluster is not None, [d.render() for d in result.errors]
    server = next(s for s in result.cluster.servers if s.name == "ber-1")
    return result.cluster, server


def test_the_reader_refuses_a_symlink_swapped_in_after_validation(tmp_path):
    # Attack: the file validates, then certs/ber-1.key is replaced by a symlink out before plan or apply reads it.
    path, secret, _, _ = _layout(tmp_path)
    cluster, server = _ber_1(path)
    key = path.parent / "certs" / "ber-1.key"
    key.unlink()
    key.symlink_to(secret)
    with pytest.raises(PermissionError, match="outside the cluster file's folder"):
        tls_files(server, SECRET, adapter_of(cluster, server).layout, str(path.parent), str(tmp_path / "acme"))


@pytest.mark.parametrize("swap", ["folder", "file"])
def test_the_reader_checks_what_it_opened(tmp_path, monkeypatch, swap):
    # Attack: a race: the path is checked, then (before it is opened) the certs folder, or the key itself, is
    # swapped for a symlink out of the repository. The read checks the opened file again and refuses it.
    from reconciler import safe_read

    path, secret, _, _ = _layout(tmp_path)
    cluster, server = _ber_1(path)
    certs = path.parent / "certs"
    real_confine = safe_read.confine

    def confine_then_swap(target: str, folders, private=()):
        resolved = real_confine(target, folders, private)
        if resolved.endswith("ber-1.key"):
            if swap == "folder":
                certs.rename(path.parent / "certs.old")
                (secret.parent / "ber-1.key").write_text(SECRET_TEXT)
                certs.symlink_to(secret.parent)
            else:
                (certs / "ber-1.key").unlink()
                (certs / "ber-1.key").symlink_to(secret)
        return resolved

    monkeypatch.setattr(safe_read, "confine", confine_then_swap)
    with pytest.raises(PermissionError, match="changed"):
        tls_files(server, SECRET, adapter_of(cluster, server).layout, str(path.parent), str(tmp_path / "acme"))


def test_the_reader_reads_a_file_inside(tmp_path):
    path, _, _, _ = _layout(tmp_path)
    cluster, server = _ber_1(path)
    files = tls_files(server, SECRET, adapter_of(cluster, server).layout, str(path.parent), str(tmp_path / "acme"))
    assert any(f.path.endswith("ber-1-trojan.key") and b"MIIE" in f.content for f in files)
