"""`reconciler validate`: every planted mistake is named at file:line:col with a hint (GITOPS-2)."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import EXAMPLE, example_text, plant

LOCATION = re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+):(?P<col>\d+): error: (?P<msg>.*)$", re.M)

# (id, old, new, nth occurrence, what the message must say, line offset of the error from the planted line)
MISTAKES = [
    ("yaml-syntax", "    pools: [central, west, backup]", "    pools: [central, west, backup", 1, "YAML syntax", None),
    ("tab", "        port: 8388\n", "\tport: 8388\n", 1, "tab character", 0),
    ("duplicate-key", "        port: 8388\n", "        port: 8388\n        port: 8389\n", 1, "duplicate key", 1),
    ("wrong-type", "    coefficient: 2.0 ", "    coefficient: lots ", 1, "coefficient: expected a number", 0),
    ("unknown-key", "        camouflage: www.example.org", "        camoflage: www.example.org", 1, "unknown key 'camoflage'", 0),
    ("unknown-settings-key", "    failure_streak: 3", "    failure_streek: 3", 1, "unknown key 'failure_streek'", 0),
    ("dangling-route", "        route: usa\n", "        route: uas\n", 1, "unknown route 'uas'", 0),
    ("dangling-pool", "        pool: west\n", "        pool: wset\n", 1, "pool 'wset'", 0),
    ("dangling-fallback", "    fallback_pool: backup ", "    fallback_pool: reserve ", 1, "fallback_pool 'reserve'", 0),
    ("dangling-geo-pool", "      EEU: [central, west]", "      EEU: [central, east]", 1, "geo EEU names pool 'east'", 0),
    ("duplicate-server", "  - name: fra-2\n", "  - name: fra-1\n", 1, "duplicate server name 'fra-1'", 0),
    ("duplicate-inbound", "      - id: fra-2-hy2\n", "      - id: fra-1-hy2\n", 1, "duplicate inbound id 'fra-1-hy2'", 0),
    ("duplicate-user", "  - name: carol", "  - name: alice", 1, "duplicate user name 'alice'", 0),
    ("port-conflict-tcp", "        port: 8443\n        tls: {server_name: dal-1", "        port: 443\n        tls: {server_name: dal-1", 1,
     "port 443/tcp on server 'dal-1' is already used by inbound 'dal-1-reality'", 0),
    ("port-conflict-ss-udp", "        port: 8388\n", "        port: 443\n", 1, "port 443/tcp on server 'ber-1'", 0),
    ("invalid-country", "    country: NL", "    country: XN", 1, "'XN' is not an ISO 3166-1 alpha-2 country code", 0),
    ("invalid-region", "    region: WNAM ", "    region: WAMN ", 1, "region: 'WAMN' is not allowed", 0),
    ("invalid-user-region", "    region: EEU\n", "    region: EUE\n", 1, "region: 'EUE' is not allowed", 0),
    ("invalid-geo-region", "      WEU: [west, central]", "      WUE: [west, central]", 1, "not a known key", 0),
    ("port-out-of-range", "        port: 8388\n", "        port: 70000\n", 1, "port: 70000 is out of range", 0),
    ("port-zero", "        port: 8388\n", "        port: 0\n", 1, "port: 0 is out of range", 0),
    ("pooled-route-no-pool", "        route: europe\n        pool: west\n", "        route: europe\n", 1,
     "names no pool", 0),
    ("unknown-protocol", "        protocol: trojan", "        protocol: trojen", 1, "unknown protocol 'trojen'", 0),
    ("bad-name", "  - name: ams-1", "  - name: Ams 1", 1, "not a valid identifier", 0),
    ("bad-duration", "    report_interval: 60s", "    report_interval: soon", 1, "not a duration", 0),
    ("tls-half-pair", "          server_name: ber-1.example.net\n",
     "          server_name: ber-1.example.net\n          certificate: certs/ber-1.pem\n", 1, "give both certificate and key", 0),
    ("missing-host", "    host: 198.51.100.21\n", "", 1, "missing required key 'host'", -1),
]


@pytest.mark.parametrize("name,old,new,nth,expected,offset", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_planted_mistake_is_named_at_its_place(cli, tmp_path, name, old, new, nth, expected, offset):
    # spec: GITOPS-2, ROUTE-3
    text, line = plant(example_text(), old, new, nth)
    path = tmp_path / "cluster.yaml"
    path.write_text(text, encoding="utf-8")
    run = cli("validate", str(path))
    assert run.rc == 1, run.text
    assert "Traceback" not in run.text
    errors = [m.groupdict() for m in LOCATION.finditer(run.err)]
    assert errors, run.err
    matching = [e for e in errors if expected in e["msg"]]
    assert matching, f"no error says {expected!r}:\n{run.err}"
    assert all(e["file"] == str(path) for e in errors)
    if offset is not None:
        assert int(matching[0]["line"]) == line + offset, run.err


def test_example_is_valid_with_the_expected_warnings(cli):
    # spec: GITOPS-1, ROUTE-4, ROUTE-5; issue 14: the official release it downloads is not pinned yet: a warning
    run = cli("validate", str(EXAMPLE))
    assert run.rc == 0, run.text
    assert "not pinned by sha256: apply refuses to install it" in run.err and "reconciler engine pin" in run.err
    assert "1 inbound is not in any route — clients cannot see them yet: ber-1-ss" in run.err
    assert "route 'japan' is empty" in run.err


def test_unknown_key_suggests_the_right_one(cli, tmp_path):
    text, _ = plant(example_text(), "        camouflage: www.example.org", "        camoflage: www.example.org")
    (tmp_path / "c.yaml").write_text(text)
    run = cli("validate", str(tmp_path / "c.yaml"))
    assert "hint: did you mean 'camouflage'?" in run.err


def test_tab_hint_says_to_use_spaces(cli, tmp_path):
    text, line = plant(example_text(), "        port: 8388\n", "\tport: 8388\n")
    (tmp_path / "c.yaml").write_text(text)
    run = cli("validate", str(tmp_path / "c.yaml"))
    assert f":{line}:1: error: YAML syntax: tab character" in run.err
    assert "spaces" in run.err


def test_port_conflict_allows_tcp_and_udp_on_one_number(cli, tmp_path):
    # fra-1 already has vless-reality 443/tcp and hysteria2 443/udp: valid.
    run = cli("validate", str(EXAMPLE))
    assert "already used" not in run.err
    # ... but a second UDP listener on 443 collides.
    text, line = plant(example_text(), "        port: 8443\n        tls: {server_name: ams-1", "        port: 443\n        tls: {server_name: ams-1")
    text, _ = plant(text, "        protocol: vless-reality\n        port: 443\n        camouflage: www.example.org",
                    "        protocol: vless-reality\n        port: 8443\n        camouflage: www.example.org")
    text, _ = plant(text, "        protocol: tuic\n", "        protocol: hysteria2\n")
    (tmp_path / "c.yaml").write_text(text)
    assert cli("validate", str(tmp_path / "c.yaml")).rc == 0
    text2, line2 = plant(
        text, "        protocol: vless-reality\n        port: 8443\n", "        protocol: tuic\n        port: 443\n        tls: {server_name: x}\n"
    )
    text2 = text2.replace("        camouflage: www.example.org\n", "", 1)
    (tmp_path / "d.yaml").write_text(text2)
    run = cli("validate", str(tmp_path / "d.yaml"))
    assert run.rc == 1
    assert "port 443/udp on server 'ams-1'" in run.err


def test_json_output_lists_errors_with_positions(cli, tmp_path):
    text, line = plant(example_text(), "        route: usa\n", "        route: uas\n")
    (tmp_path / "c.yaml").write_text(text)
    run = cli("validate", str(tmp_path / "c.yaml"), "--json")
    assert run.rc == 1
    doc = json.loads(run.out)
    assert doc["valid"] is False
    err = doc["errors"][0]
    assert err["line"] == line and err["col"] == 16 and "uas" in err["message"] and err["hint"] == "did you mean 'usa'?"
    ok = json.loads(cli("validate", str(EXAMPLE), "--json").out)
    assert ok["valid"] is True and ok["summary"]["servers"] == 7 and ok["errors"] == []
    # Two about routes (ROUTE-4, ROUTE-5), one about the unpinned engine release, two about its placeholders (the
    # addresses and the camouflages), and one per server without a pinned host key (the example pins none).
    assert sorted(w["code"] for w in ok["warnings"] if w["code"] != "host-key") == [
        "empty-route", "engine-unpinned", "placeholder", "placeholder", "unassigned"]
    assert len([w for w in ok["warnings"] if w["code"] == "host-key"]) == 7


@pytest.mark.parametrize(
    "content,expected",
    [
        ("", "the file is empty"),
        ("- a\n- b\n", "the top level must be a mapping"),
        ("just text\n", "the top level must be a mapping"),
        ("servers: 3\n", "servers: expected a list"),
        ("servers:\n  - 42\n", "expected a mapping"),
        ("servers: &a\n  - name: x\n    inbounds: *a\n", "an alias refers to a list or mapping that contains it"),
        ("\x00\x01binary", "YAML"),
        # an escaped surrogate is not a character: refused where it is written (found by the property test)
        ('users: [{name: "\\ud83c"}]\n', "1:19: error: YAML syntax: found invalid Unicode character escape code"),
        ('includes: ["\\ud800\\udc00"]\n', "1:15: error: YAML syntax: found invalid Unicode character escape code"),
        ('includes: ["a\\0b"]\n', "NUL"),
    ],
)
def test_odd_inputs_give_errors_not_tracebacks(cli, tmp_path, content, expected):
    path = tmp_path / "c.yaml"
    path.write_text(content)
    run = cli("validate", str(path))
    assert run.rc == 1
    assert expected in run.err or expected in run.out, run.text
    assert "Traceback" not in run.text and "internal error" not in run.text


def test_alias_bomb_is_refused(cli, tmp_path):
    lines = ["settings:", "  a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]  # under a key the file may hold
    for i in range(1, 9):
        lines.append(f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    (tmp_path / "c.yaml").write_text("\n".join(lines) + "\n")
    run = cli("validate", str(tmp_path / "c.yaml"))
    assert run.rc == 1 and "expands to more than" in run.err


def test_missing_file_and_directory(cli, tmp_path):
    run = cli("validate", str(tmp_path / "nope.yaml"))
    assert run.rc == 1 and "file not found" in run.err
    run = cli("validate", str(tmp_path))
    assert run.rc == 1 and "directory" in run.err


def test_non_utf8_file(cli, tmp_path):
    (tmp_path / "c.yaml").write_bytes(b"servers: []\nname: \xff\xfe\n")
    run = cli("validate", str(tmp_path / "c.yaml"))
    assert run.rc == 1 and ":2:1: error: not UTF-8" in run.err
