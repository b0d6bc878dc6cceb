"""`route assign` / `route unassign` edit the file in place; every other byte stays (ROUTE-3)."""

from __future__ import annotations

import difflib

import pytest

from reconciler.config import load_cluster
from tests.conftest import example_text


def _changed_lines(before: str, after: str) -> tuple[list[str], list[str]]:
    removed, added = [], []
    for line in difflib.ndiff(before.splitlines(), after.splitlines()):
        if line.startswith("- "):
            removed.append(line[2:])
        elif line.startswith("+ "):
            added.append(line[2:])
    return removed, added


@pytest.fixture
def cluster_file(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(example_text())
    return path


def test_assign_an_unassigned_inbound_adds_one_line(cli, cluster_file):
    # spec: ROUTE-3, ROUTE-5
    before = cluster_file.read_text()
    run = cli("route", "assign", "ber-1-ss", "japan", "-f", str(cluster_file))
    assert run.rc == 0, run.text
    after = cluster_file.read_text()
    assert _changed_lines(before, after) == ([], ["        route: japan"])
    result = load_cluster(str(cluster_file))
    assert result.ok and result.cluster.route_of("ber-1-ss") == "japan"
    assert not result.cluster.unassigned  # ROUTE-4 warning gone
    assert not any("is empty" in w.message for w in result.warnings)  # ROUTE-5: japan now appears


def test_assign_moves_an_inbound_from_its_route(cli, cluster_file):
    # spec: ROUTE-3: one inbound, at most one route; moving is a one-line edit
    before = cluster_file.read_text()
    run = cli("route", "assign", "ny-1-reality", "fast", "-f", str(cluster_file))
    assert run.rc == 0 and "moved from usa" in run.out
    assert _changed_lines(before, cluster_file.read_text()) == (["        route: usa"], ["        route: fast"])


def test_assign_into_a_pooled_route_needs_a_pool(cli, cluster_file):
    before = cluster_file.read_text()
    run = cli("route", "assign", "ny-1-reality", "europe", "-f", str(cluster_file))
    assert run.rc == 1 and "--pool" in run.err
    assert cluster_file.read_text() == before
    run = cli("route", "assign", "ny-1-reality", "europe", "--pool", "west", "-f", str(cluster_file))
    assert run.rc == 0, run.text
    assert _changed_lines(before, cluster_file.read_text()) == (
        ["        route: usa"], ["        route: europe", "        pool: west"])


def test_moving_out_of_a_pooled_route_drops_the_pool_and_keeps_other_comments(cli, cluster_file):
    before = cluster_file.read_text()
    assert cli("route", "assign", "dal-1-tls", "usa", "-f", str(cluster_file)).rc == 0
    removed, added = _changed_lines(before, cluster_file.read_text())
    assert removed == ["        route: europe", '        pool: backup                # the fallback pool of route "europe"']
    assert added == ["        route: usa"]


def test_unassign_removes_the_line(cli, cluster_file):
    # spec: ROUTE-4
    before = cluster_file.read_text()
    run = cli("route", "unassign", "fra-2-hy2", "-f", str(cluster_file))
    assert run.rc == 0
    assert _changed_lines(before, cluster_file.read_text()) == (["        route: fast"], [])
    assert "2 inbounds are not in any route" in run.err


def test_flow_style_inbounds_are_edited_in_place(cli, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "servers:\n"
        "  - name: s1  # the only server\n"
        "    host: 192.0.2.1\n"
        "    country: DE\n"
        "    inbounds:\n"
        "      - {id: a, name: A, protocol: shadowsocks-2022, port: 1001}   # keep me\n"
        "      - {id: b, name: B, protocol: shadowsocks-2022, port: 1002, route: r1}\n"
        "routes:\n  - {id: r1, name: R1}\n  - {id: r2, name: R2}\n"
    )
    assert cli("route", "assign", "a", "r2", "-f", str(path)).rc == 0
    assert "      - {id: a, name: A, protocol: shadowsocks-2022, port: 1001, route: r2}   # keep me\n" in path.read_text()
    assert cli("route", "unassign", "b", "-f", str(path)).rc == 0
    assert "      - {id: b, name: B, protocol: shadowsocks-2022, port: 1002}\n" in path.read_text()
    assert cli("route", "assign", "b", "r1", "-f", str(path)).rc == 0
    assert "port: 1002, route: r1}" in path.read_text()
    assert load_cluster(str(path)).ok


def test_an_inbound_whose_first_key_is_route(cli, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "servers:\n  - name: s1\n    host: 192.0.2.1\n    country: DE\n    inbounds:\n"
        "      - route: r1\n        id: a\n        name: A\n        protocol: shadowsocks-2022\n        port: 1001\n"
        "routes:\n  - id: r1\n    name: R1\n"
    )
    assert cli("route", "unassign", "a", "-f", str(path)).rc == 0
    text = path.read_text()
    assert "      - id: a\n        name: A\n" in text and "route:" not in text.split("routes:")[0]
    assert load_cluster(str(path)).ok


def test_unknown_names_and_invalid_files_write_nothing(cli, cluster_file):
    before = cluster_file.read_text()
    assert cli("route", "assign", "nope", "usa", "-f", str(cluster_file)).rc == 1
    assert cli("route", "assign", "ny-1-reality", "nope", "-f", str(cluster_file)).rc == 1
    assert cli("route", "assign", "ny-1-reality", "usa", "--pool", "x", "-f", str(cluster_file)).rc == 1
    assert cluster_file.read_text() == before
    cluster_file.write_text(before.replace("country: NL", "country: XX"))
    run = cli("route", "assign", "ber-1-ss", "japan", "-f", str(cluster_file))
    assert run.rc == 1 and "fix them first" in run.err and "XX" in run.err


def test_assign_edits_the_included_file_that_holds_the_inbound(cli, tmp_path):
    (tmp_path / "servers.d").mkdir()
    (tmp_path / "servers.d" / "extra.yaml").write_text(
        "# extra servers\nservers:\n  - name: x1\n    host: 192.0.2.9\n    country: FR\n    inbounds:\n"
        "      - id: x1-ss\n        name: X\n        protocol: shadowsocks-2022\n        port: 9000\n"
    )
    main = tmp_path / "cluster.yaml"
    main.write_text(example_text().replace("# includes: [users.d/*.yaml]", "includes: [servers.d/*.yaml]"))
    before_main = main.read_text()
    assert cli("route", "assign", "x1-ss", "japan", "-f", str(main)).rc == 0
    assert main.read_text() == before_main
    assert "        route: japan\n" in (tmp_path / "servers.d" / "extra.yaml").read_text()
    assert load_cluster(str(main)).cluster.route_of("x1-ss") == "japan"


def test_the_implicit_default_route_cannot_be_unassigned(cli, tmp_path):
    # spec: ROUTE-6
    path = tmp_path / "c.yaml"
    path.write_text("servers:\n  - name: s1\n    host: 192.0.2.1\n    country: DE\n    inbounds:\n"
                    "      - {id: a, name: A, protocol: shadowsocks-2022, port: 1001}\n")
    run = cli("route", "unassign", "a", "-f", str(path))
    assert run.rc == 1 and "implicit 'default' route" in run.err


@pytest.mark.parametrize("pool", ["a, method: 2022-blake3-aes-256-gcm", "west\n        port: 1", "West", "a}b", "x" * 100])
def test_a_pool_that_is_not_a_name_is_refused_before_the_file_is_touched(cli, cluster_file, pool):
    # issue 13: `--pool 'a, method: …'` once spliced an extra key into the file
    before = cluster_file.read_text()
    run = cli("route", "assign", "ny-1-reality", "europe", "--pool", pool, "-f", str(cluster_file))
    assert run.rc == 1 and "is not a valid name" in run.err, run.text
    assert "Traceback" not in run.text and "internal error" not in run.text
    assert cluster_file.read_text() == before


def test_a_route_that_is_not_a_name_is_refused(cli, cluster_file):
    before = cluster_file.read_text()
    run = cli("route", "assign", "ber-1-ss", "japan, pool: x", "-f", str(cluster_file))
    assert run.rc == 1 and "is not a valid name" in run.err
    assert cluster_file.read_text() == before


def test_a_name_yaml_would_read_as_another_type_is_quoted():
    from reconciler.config.edit import _yaml_scalar

    assert _yaml_scalar("west") == "west"
    for value in ("null", "true", "123", "1.5", "2026-01-01", "0x1f", "1e5"):
        assert _yaml_scalar(value) == f'"{value}"'


def test_editing_a_symlinked_cluster_file_writes_its_target_and_keeps_the_link(cli, tmp_path):
    # issue 13: the edit replaced the link with a regular file
    real_dir = tmp_path / "repo"
    real_dir.mkdir()
    target = real_dir / "cluster.yaml"
    target.write_text(example_text())
    target.chmod(0o640)
    link = tmp_path / "cluster.yaml"
    link.symlink_to(target)
    run = cli("route", "assign", "ber-1-ss", "japan", "-f", str(link))
    assert run.rc == 0, run.text
    assert link.is_symlink() and link.resolve() == target
    assert "        route: japan" in target.read_text()
    assert target.stat().st_mode & 0o777 == 0o640


def test_an_edit_of_a_file_with_a_reused_anchor_works(cli, cluster_file):
    # ruamel warns about a reused anchor; under `-W error` that was an exception
    text = example_text().replace("    host: 203.0.113.12\n", "    host: &h 203.0.113.12\n    region: &h WEU\n", 1)
    cluster_file.write_text(text)
    run = cli("route", "assign", "ber-1-ss", "japan", "-f", str(cluster_file))
    assert run.rc == 0, run.text
