"""Includes: users (and servers, routes) from other files; errors point into them (GITOPS-1, GITOPS-2)."""

from __future__ import annotations

import json

from tests.conftest import example_text, plant


def _with_includes(tmp_path, users_text: str, include: str = "users.d/*.yaml"):
    text, _ = plant(example_text(), "# includes: [users.d/*.yaml]", f"includes: [{include}]")
    (tmp_path / "cluster.yaml").write_text(text)
    (tmp_path / "users.d").mkdir()
    (tmp_path / "users.d" / "team.yaml").write_text(users_text)
    return tmp_path / "cluster.yaml"


def test_users_from_an_included_file_are_appended(cli, tmp_path):
    path = _with_includes(tmp_path, "users:\n  - name: erin\n  - name: frank\n    region: SEAS\n")
    run = cli("validate", str(path), "--json")
    doc = json.loads(run.out)
    assert doc["errors"] == [], run.text
    assert doc["summary"]["users"] == 6


def test_an_error_in_an_included_file_points_into_it(cli, tmp_path):
    path = _with_includes(tmp_path, "users:\n  - name: erin\n  - name: frank\n    regoin: SEAS\n")
    run = cli("validate", str(path))
    assert run.rc == 1
    assert "users.d/team.yaml:4:5: error: unknown key 'regoin'" in run.err
    assert "did you mean 'region'?" in run.err


def test_a_duplicate_across_files_names_both_places(cli, tmp_path):
    path = _with_includes(tmp_path, "users:\n  - name: erin\n  - name: alice\n")
    run = cli("validate", str(path))
    assert run.rc == 1
    assert "users.d/team.yaml:3:11: error: duplicate user name 'alice' (first at" in run.err
    assert "cluster.yaml:" in run.err.split("first at")[1]


def test_yaml_errors_in_included_files_and_missing_includes(cli, tmp_path):
    path = _with_includes(tmp_path, "users:\n  - name: erin\n   - name: x\n")
    run = cli("validate", str(path))
    assert run.rc == 1 and "users.d/team.yaml:3:" in run.err and "YAML syntax" in run.err
    text = path.read_text().replace("includes: [users.d/*.yaml]", "includes: [nope.yaml]")
    path.write_text(text)
    run = cli("validate", str(path))
    line = next(i for i, x in enumerate(text.splitlines(), 1) if x.startswith("includes: [nope.yaml]"))
    assert run.rc == 1 and f"cluster.yaml:{line}:12: error: include 'nope.yaml': file not found" in run.err


def test_included_files_may_not_change_settings(cli, tmp_path):
    path = _with_includes(tmp_path, "settings:\n  harden: false\nusers: []\n")
    run = cli("validate", str(path))
    assert run.rc == 1 and "team.yaml:1:1: error: 'settings' cannot be set in an included file" in run.err
