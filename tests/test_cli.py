"""Commands around validation: init, demo, routes, usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from reconciler.config import load_cluster
from tests.conftest import EXAMPLE, ROOT


def test_init_scaffolds_a_valid_file_with_the_default_route_spelled_out(cli, tmp_path):
    # spec: ROUTE-6
    path = tmp_path / "cluster.yaml"
    run = cli("init", str(path))
    assert run.rc == 0, run.text
    result = load_cluster(str(path))
    # the official release, REALITY-capable: a warning says to pin it; the placeholders (address, camouflage) too
    assert result.ok and [w.code for w in result.warnings] == ["engine-unpinned", "placeholder", "placeholder"]
    assert result.cluster.settings.engine.install == "download" and result.cluster.settings.engine.name == "sing-box"
    # sing-box's Arch package, named by the kernel's architecture (x86_64, aarch64): zstd, unpacked in ~42% of the CPU
    assert result.cluster.settings.engine.url.endswith("/sing-box_{version}_linux_{machine}.pkg.tar.zst")
    assert [r.id for r in result.cluster.routes] == ["default"] and not result.cluster.routes[0].implicit
    assert not (tmp_path / "schemas").exists()  # it writes the one file it was given
    assert cli("init", str(path)).rc == 1  # never overwrites silently
    assert cli("init", str(path), "--force").rc == 0
    assert cli("init", str(path), "--force", "--engine", "mihomo").rc == 0
    mihomo = load_cluster(str(path))
    assert mihomo.ok and mihomo.cluster.settings.engine.name == "mihomo" and "mihomo-linux-{arch}" in path.read_text()


def test_routes_lists_routes_in_order(cli):
    # spec: ROUTE-7
    run = cli("routes", "-f", str(EXAMPLE))
    assert run.rc == 0
    positions = [run.out.index(name) for name in ("Europe", "USA", "Fast (UDP)", "Japan")]
    assert positions == sorted(positions)


def test_console_script_runs_without_a_command_and_with_bad_usage():
    exe = os.path.join(os.path.dirname(sys.executable), "reconciler")
    out = subprocess.run([exe, "validate", str(EXAMPLE)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    out = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    out = subprocess.run([exe, "route"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr


def _commands(parser, prefix=()):
    """(command path, its parser) for every command and subcommand."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from _commands(sub, (*prefix, name))


def test_every_command_and_option_has_help_and_an_example():
    from reconciler.cli import parser

    commands = list(_commands(parser()))
    assert len(commands) >= 16
    for path, sub in commands:
        assert sub.description and "example:\n  reconciler " in (sub.epilog or ""), path
        for action in sub._actions:
            assert action.help, (path, action.dest)


def test_every_command_takes_the_cluster_file_the_same_way():
    from reconciler.cli import parser

    for path, sub in _commands(parser()):
        options = {o for a in sub._actions for o in a.option_strings}
        takes_file = any(a.dest == "file" for a in sub._actions)
        if takes_file:
            assert {"-f", "--file"} <= options, path


def test_cli_modules_stay_small():
    for module in (ROOT / "reconciler" / "cli").glob("*.py"):
        assert len(module.read_text().splitlines()) <= 150, module.name


def test_validate_warns_where_a_first_contact_would_trust_any_host_key(cli, tmp_path):
    import json as _json

    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPeQzPkYcMRVOS+n3EuWQ3bBT5elEQ4vzjxK1JDKXKhR"
    path = tmp_path / "cluster.yaml"
    path.write_text("servers:\n"
                    f"  - {{name: pinned, host: 198.18.0.10, country: DE, ssh: {{host_key: \"{key}\"}}, inbounds: []}}\n"
                    "  - {name: open, host: 198.18.0.11, country: DE, inbounds: []}\n")
    run = cli("validate", "-f", str(path))
    assert run.rc == 0, run.text
    assert "cluster.yaml:3:5: warning: first contact with open (198.18.0.11:22)" in run.err and "pinned (" not in run.err
    state = tmp_path / ".reconciler"
    state.mkdir()
    (state / "known_hosts.json").write_text(_json.dumps({"198.18.0.11:22": key}))
    run = cli("validate", "-f", str(path), "--json")
    assert not [w for w in _json.loads(run.out)["warnings"] if "first contact" in w["message"]]


def test_shell_completion_completes_commands_options_and_choices(tmp_path):
    # issue 15: completion for bash, zsh and fish, from the parser the commands use (argcomplete's protocol)
    exe = os.path.join(os.path.dirname(sys.executable), "reconciler")

    def complete(line: str) -> set[str]:
        out = tmp_path / "completions"
        env = {**os.environ, "_ARGCOMPLETE": "1", "COMP_LINE": line, "COMP_POINT": str(len(line)),
               "_ARGCOMPLETE_IFS": "\n", "_ARGCOMPLETE_STDOUT_FILENAME": str(out)}
        subprocess.run([exe], env=env, capture_output=True, timeout=60)
        return {c.strip() for c in out.read_text().split("\n")} - {""}

    assert {"plan", "apply", "show"} <= complete("reconciler ")
    assert complete("reconciler pl") == {"plan"}
    assert {"--server", "--keep", "--out"} <= complete("reconciler plan --")
    assert complete("reconciler status -o ") == {"table", "json", "yaml"}
    for shell in ("bash", "zsh", "fish"):
        code = subprocess.run([exe, "completion", shell], capture_output=True, text=True, timeout=60)
        assert code.returncode == 0 and "_ARGCOMPLETE" in code.stdout
    bash = subprocess.run(["bash", "-c", f"source <({exe} completion bash) && complete -p reconciler"], capture_output=True,
                          text=True, timeout=60)
    assert bash.returncode == 0 and "reconciler" in bash.stdout, bash.stderr


def test_status_lists_the_fleet_describes_a_server_in_every_output_format(cli, tmp_path, monkeypatch):
    # issue 15: `status` like kubectl get, `status SERVER` like describe, -o table|json|yaml, warnings included
    from ruamel.yaml import YAML

    monkeypatch.setenv("RECONCILER_SECRET", "status-test-secret-0123456789abcdef")
    fleet = json.loads(cli("status", "-f", str(EXAMPLE), "-o", "json").out)
    assert [r["server"] for r in fleet["servers"]][:2] == ["fra-1", "fra-2"]
    assert fleet["servers"][0]["engine"] == "sing-box 1.14.4" and fleet["servers"][0]["status"] == "no_data"
    assert any("ber-1-ss" in w for w in fleet["warnings"]) and any("japan" in w for w in fleet["warnings"])
    described = YAML(typ="safe").load(cli("status", "fra-1", "-o", "yaml", "-f", str(EXAMPLE)).out)
    assert described["server"] == "fra-1" and [i["inbound"] for i in described["inbounds"]] == ["fra-1-reality", "fra-1-hy2"]
    assert "never reported" in described["reason"]
    table = cli("status", "-f", str(EXAMPLE))
    assert table.rc == 0 and "fra-1" in table.out and "warning: route 'japan' is empty" in table.err
    user = json.loads(cli("status", "bob", "--json", "-f", str(EXAMPLE)).out)
    assert user["user"] == "bob" and user["entries"]


def test_connection_failures_are_said_in_the_operators_words():
    # issue 15: "cannot reach fra-1 at 203.0.113.11:22: connection refused", never a raw [Errno 111]
    import socket

    from reconciler.ssh.pool import in_words

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError as exc:
        refused = exc
    assert in_words(refused).startswith("connection refused") and "Errno" not in in_words(refused)
    try:
        socket.getaddrinfo("name.invalid", 22)
    except OSError as exc:
        assert in_words(exc) == "the name does not resolve (check `host:`)"
    assert in_words(TimeoutError()).startswith("timed out")
    assert in_words(None).startswith("timed out")


def test_read_commands_share_one_output_option(cli):
    # issue 15: -o table|json|yaml on the read commands (routes, status)
    from ruamel.yaml import YAML

    doc = json.loads(cli("routes", "-o", "json", "-f", str(EXAMPLE)).out)
    assert [r["id"] for r in doc["routes"]][:1] == ["europe"] and doc["unassigned"] == ["ber-1-ss"]
    assert YAML(typ="safe").load(cli("routes", "-o", "yaml", "-f", str(EXAMPLE)).out) == doc


def test_user_url_hands_out_the_subscription_url_and_its_qr_code(cli, tmp_path, monkeypatch):
    # issue 16 (item 4, first part): the URL under settings.outputs.public_url, the token derived from the secret
    import io

    import segno

    from reconciler.credentials import Secret, user_token

    secret = "user-url-test-secret-0123456789abcdef"
    monkeypatch.setenv("RECONCILER_SECRET", secret)
    path = tmp_path / "cluster.yaml"
    path.write_text("settings: {outputs: {public_url: \"https://vpn.example.net/\"}}\nservers: []\n"
                    "users: [{name: alice}, {name: bob, enabled: false}]\n")
    run = cli("user", "url", "alice", "-f", str(path))
    assert run.rc == 0 and run.out == f"https://vpn.example.net/sub/{user_token(Secret(secret.encode()), 'alice')}\n"
    clash = cli("user", "url", "alice", "--format", "clash", "--qr", "-f", str(path))
    url = clash.out.splitlines()[0]
    assert url.endswith("/clash")
    drawn = io.StringIO()
    segno.make(url, error="m").terminal(out=drawn, compact=True)
    assert clash.out == url + "\n" + drawn.getvalue() and "█" in drawn.getvalue()
    assert "refusal" in cli("user", "url", "bob", "-f", str(path)).err
    assert "did you mean 'alice'" in cli("user", "url", "alicia", "-f", str(path)).err
    path.write_text("servers: []\nusers: [{name: alice}]\n")
    missing = cli("user", "url", "alice", "-f", str(path))
    assert missing.rc == 1 and "public_url is not set" in missing.err
