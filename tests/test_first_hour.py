"""An operator's first hour: what a new operator meets, from `init` to handing a user the URL, says what it means.

Each test here failed on the code before it: the starter files could not give a user's URL, `validate` passed
files `plan` rejected, a refusal went to stdout with exit 0, `init` wrote a second file, placeholders passed
silently, help and docs cited a tracker, the README's table missed commands, and the public listener named its
software and answered 404 to every token until its first snapshot.
"""

from __future__ import annotations

import asyncio
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from reconciler.cli.commands import COMMANDS
from reconciler.credentials import Secret
from reconciler.lab.demo import free_port
from reconciler.loop.http import HttpOutlet
from reconciler.loop.public import STARTING_RETRY_AFTER
from reconciler.publish import LiveAnswers, Tokens
from tests.conftest import EXAMPLE, example_text

ROOT = Path(__file__).resolve().parent.parent
SECRET = "first-hour-test-secret-0123456789abcdef"
TRACKER = re.compile(r"\bissues? #?\d+|\(#\d+\)", re.I)


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECONCILER_SECRET", SECRET)


def test_both_starter_files_give_a_users_url(cli, tmp_path, secret):
    run = cli("user", "url", "alice", "-f", str(EXAMPLE))
    assert run.rc == 0 and run.out.startswith("http://127.0.0.1:8080/sub/"), run.err
    path = tmp_path / "cluster.yaml"
    assert cli("init", "-f", str(path)).rc == 0
    run = cli("user", "url", "me", "-f", str(path))
    assert run.rc == 0 and run.out.startswith("http://127.0.0.1:8080/sub/"), run.err
    # Without public_url: it says what to set, where, and the option that does without it.
    path.write_text(path.read_text().replace("    public_url: http://127.0.0.1:8080", "    # public_url: unset"))
    run = cli("user", "url", "me", "-f", str(path))
    assert run.rc == 1 and "settings.outputs.public_url is not set" in run.err and "--base URL" in run.err
    run = cli("user", "url", "me", "--base", "https://vpn.example.net/x", "-f", str(path))
    assert run.rc == 0 and run.out.startswith("https://vpn.example.net/x/sub/")
    run = cli("user", "url", "me", "--base", "vpn.example.net?x=1", "-f", str(path))
    assert run.rc == 1 and "not an http(s) URL" in run.err


def test_validate_finds_the_missing_files_plan_would(cli, tmp_path, monkeypatch):
    text = example_text()
    path = tmp_path / "cluster.yaml"
    path.write_text(text.replace("    ssh: {user: root, port: 22", "    ssh: {user: root, identity: keys/none, port: 22", 1))
    run = cli("validate", "-f", str(path))
    assert run.rc == 0, run.out  # the controller's credential: CI may validate before it installs it; plan fails
    assert re.search(r"cluster\.yaml:\d+:\d+: warning: ssh.identity of server '[^']+': 'keys/none' is not a file here: "
                     r"plan and apply cannot reach the server with it", run.out + run.err), run.out + run.err
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "none").write_text("a key\n")
    monkeypatch.chdir(tmp_path)  # an identity is read from the working directory, as the SSH pool reads it
    assert "keys/none" not in (lambda r: r.out + r.err)(cli("validate", "-f", str(path)))


def test_validate_finds_a_missing_certificate_and_key(cli, tmp_path):
    from reconciler.config import load_cluster

    path = tmp_path / "cluster.yaml"
    path.write_text("servers:\n  - name: a\n    host: 198.18.0.10\n    country: DE\n    inbounds:\n"
                    "      - {id: a-t, name: T, protocol: trojan, port: 8443, tls: {server_name: vpn.test.local, "
                    "certificate: certs/a.crt, key: certs/a.key}}\nusers:\n  - name: alice\n")
    errors = [d for d in load_cluster(str(path)).errors if d.code == "file"]
    assert [(d.line, "certificate" in d.message or "key" in d.message) for d in errors] == [(6, True), (6, True)], errors
    (tmp_path / "certs").mkdir()
    for name in ("a.crt", "a.key"):
        (tmp_path / "certs" / name).write_text("x\n")
    assert not [d for d in load_cluster(str(path)).errors if d.code == "file"]


def test_a_refused_user_gets_no_document_on_stdout_and_a_failing_exit(cli, secret):
    run = cli("subscription", "dave", "--format", "clash", "-f", str(EXAMPLE))  # dave is disabled in the example
    assert run.rc == 1 and run.out == ""
    assert "dave is refused" in run.err and "error:" in run.err


def test_init_writes_only_the_file_it_was_given(cli, tmp_path):
    path = tmp_path / "deep" / "cluster.yaml"
    run = cli("init", "-f", str(path))
    assert run.rc == 0 and path.exists()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["deep", "deep/cluster.yaml"]
    assert "reconciler schema" in run.out  # how to have the schema, when it is wanted


def test_placeholders_are_warned_about(cli, tmp_path):
    path = tmp_path / "cluster.yaml"
    cli("init", "-f", str(path))
    run = cli("validate", "-f", str(path))
    shown = run.out + run.err
    assert run.rc == 0, shown  # a warning, not an error: the file is valid
    assert re.search(r"cluster\.yaml:\d+:\d+: warning: 1 server has a placeholder for an address, where no server "
                     r"answers: vps-1 \(203\.0\.113\.10: a documentation address\)", shown), shown
    assert ("1 REALITY inbound has a placeholder for a camouflage, so strangers probing would see no real site: "
            "vps-1-reality (www.example.com: a name reserved for examples)") in shown
    path.write_text(path.read_text().replace("203.0.113.10", "198.18.0.10").replace("www.example.com", "www.kernel.org"))
    assert "has a placeholder" not in (lambda r: r.out + r.err)(cli("validate", "-f", str(path)))


def _helps(cli) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Every command's and sub-command's --help."""
    texts = {"": cli("--help").out}
    for name in COMMANDS:
        texts[name] = cli(name, "--help").out
        for sub in re.findall(r"^    (\w[\w-]*)  ", texts[name], re.M):
            texts[f"{name} {sub}"] = cli(name, sub, "--help").out
    return texts


def test_no_help_text_or_document_cites_a_tracker(cli):
    helps = _helps(cli)
    assert len(helps) > len(COMMANDS)  # the sub-commands too
    cited = {name: TRACKER.findall(text) for name, text in helps.items() if TRACKER.search(text)}
    assert not cited, cited
    files = [ROOT / "README.md", EXAMPLE, *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("*"))]
    files += sorted((ROOT / "deploy").rglob("*")) + sorted((ROOT / "reconciler").rglob("*.py"))
    cited_in = {str(p.relative_to(ROOT)): TRACKER.findall(p.read_text(errors="replace"))
                for p in files if p.is_file() and TRACKER.search(p.read_text(errors="replace"))}
    assert not cited_in, cited_in


def test_the_readme_table_lists_every_command():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| command | what it does |"):]
    table = table[:table.index("\n\n")]
    missing = [name for name in COMMANDS if not re.search(rf"`(reconciler )?{re.escape(name)}\b", table)]
    assert not missing, missing
    for group in ("secret new", "hostkeys pin", "engine pin", "user url"):
        assert f"`reconciler {group}" in table, group


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_the_public_listener_names_no_software_and_asks_apps_to_wait_until_it_has_a_snapshot():
    secret = Secret(SECRET.encode())
    answers = LiveAnswers(secret, Tokens(secret))
    outlet = HttpOutlet(answers, None, lambda: None, lambda: (True, "ok"))  # type: ignore[arg-type]
    port = free_port()

    async def scenario() -> tuple[tuple[int, dict[str, str], bytes], ...]:
        await outlet.start("127.0.0.1", port, operations=("127.0.0.1", free_port()))
        try:
            early = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/sub/{'A' * 32}")
            health = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/healthz")
            missing = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/nothing")

            def garbage() -> bytes:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
                    return s.recv(4096)
            raw = await asyncio.to_thread(garbage)
            return early, health, missing, (0, {}, raw)
        finally:
            await outlet.stop()

    early, health, missing, (_, _, raw) = asyncio.run(scenario())
    assert early[0] == 503 and early[1].get("Retry-After") == str(STARTING_RETRY_AFTER), early
    for _status, headers, _body in (early, health, missing):
        assert "Server" not in headers, headers
    assert raw.startswith(b"HTTP/1.") and b" 400 " in raw[:20] and b"\r\nserver:" not in raw.lower(), raw[:200]


def test_status_names_why_a_server_is_silent_and_health_and_metrics_count_it(tmp_path, cli):
    # A server SSH cannot reach, one whose agent is not installed, one whose answer is not a report: each says why,
    # in the verdict's reason (status, /status.json, the page), in /healthz and in the metrics; none says
    # "agent not answering" for a server that SSH never reached.
    from prometheus_client import generate_latest

    from reconciler.fleet.learned import Learned
    from reconciler.loop.clock import FakeClock
    from reconciler.loop.service import Loop
    from tests.fake_agents import HEALTHY, answering, install_agent, shadowsocks_fleet

    path, cluster, runner = shadowsocks_fleet(tmp_path, "abcd")
    install_agent(runner, "a", HEALTHY)
    runner.host("b").reachable = False
    install_agent(runner, "c", answering(["not", "a", "report"]))
    runner.host("d")  # nothing installed: the agent's path is missing
    clock = FakeClock()
    loop = Loop(str(path), cluster, Secret(SECRET.encode()), watch=False, runner=runner, clock=clock)

    async def intervals() -> None:
        for _ in range(2):
            assert await loop.tick() is not None
            clock.advance(60)
    asyncio.run(intervals())
    assert loop.view is not None and loop.view.verdicts is not None
    reasons = {s: loop.view.verdicts.server(s).reason for s in "abcd"}
    assert reasons["b"].startswith("no data — SSH unreachable: b (198.18.0.11:22): cannot connect"), reasons
    assert reasons["c"].startswith("no data — report refused: "), reasons
    assert reasons["d"].startswith("no data — agent silent: ") and "apply first" in reasons["d"], reasons
    assert "never reported" in reasons["b"]
    ok, why = loop._healthy()
    assert ok and "3 of 4 server(s) gave no report" in why and "b: SSH unreachable" in why, why
    metrics = generate_latest(loop.registry).decode()
    for cause, n in (("ssh", 1), ("agent", 1), ("refused", 1), ("backoff", 0)):
        assert f'reconciler_servers_unreported{{cause="{cause}"}} {n}.0' in metrics, cause
    # The saved state keeps why: `status` from another process says it too.
    loop._save()
    saved = Learned.from_bytes((tmp_path / ".reconciler" / "learned.npz").read_bytes())
    assert saved.silent["b"].startswith("SSH unreachable") and "a" not in saved.silent
    # No server answering at all: /healthz is unhealthy and says why; the interval is not a collection that worked.
    for name in "acd":
        runner.host(name).reachable = False
    asyncio.run(loop.tick())
    ok, why = loop._healthy()
    assert not ok and why.startswith("no server reported in interval 3: a: SSH unreachable"), why
    assert 'reconciler_reconcile_total{kind="collect",result="error"} 1.0' in generate_latest(loop.registry).decode()


#: Help examples that need a real server, root or the network: shown by the lab tests, not run here.
NEEDS_SERVERS = ("reconciler apply", "reconciler plan", "reconciler show", "reconciler run", "reconciler lab",
                 "reconciler demo", "reconciler engine pin", "reconciler hostkeys pin")


def test_every_help_example_runs_on_the_example_cluster(cli, tmp_path, monkeypatch, secret):
    # Each command's `example:` line, as an operator copies it, in a folder holding the example as cluster.yaml
    # (the default file); the scenarios come from the package (`simulate --example`), not from this checkout.
    examples = sorted({line.strip() for text in _helps(cli).values()
                       for line in text.split("example:\n", 1)[-1].splitlines() if line.strip().startswith("reconciler ")})
    assert "reconciler simulate --example block" in examples
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cluster.yaml").write_text(example_text())
    assert cli("schema").rc == 0  # what `schema --check` checks
    ran = []
    for example in examples:
        if example.startswith(NEEDS_SERVERS):
            continue
        words = example.split()[1:]
        for redirect in (">>", ">"):  # a shell redirection: the command before it
            if redirect in words:
                words = words[:words.index(redirect)]
        if words[0] == "init":
            words[-1] = str(tmp_path / "new" / "cluster.yaml")
        run = cli(*words)
        assert run.rc == 0 and "Traceback" not in run.err, (example, run.out[-500:], run.err[-500:])
        ran.append(example)
    assert len(ran) >= 12, ran


def test_the_status_of_a_cluster_that_never_ran_says_so(cli, tmp_path, monkeypatch, secret):
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cluster.yaml").write_text(example_text())
    run = cli("status", "alice")
    assert run.rc == 0 and "has not run with cluster.yaml's state folder yet" in run.err
    assert "kept from the last assignment" not in run.out and "ok " not in run.out  # nothing was ever assigned
    doc = json.loads(cli("status", "alice", "-o", "json").out)
    assert doc["run_yet"] is False and {e["status"] for e in doc["entries"]} == {"not run yet"}
    fleet = json.loads(cli("status", "-o", "json").out)
    assert {s["why"] for s in fleet["servers"]} == {
        "no data — not collected yet: `reconciler run` has not run with this state folder (never reported)"}
    run = cli("status", "nobody")
    assert run.rc == 1 and "no server or user 'nobody'" in run.err
    assert "did you mean 'fra-1'?" in cli("status", "fra1").err
    users = json.loads(cli("users", "-o", "json").out)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", users["time"])
    bob = next(u for u in users["users"] if u["name"] == "bob")
    assert bob["expires"] == "2027-06-30T23:59:59Z" and bob["next_reset"].endswith("T00:00:00Z")
    assert "1 of 4 user(s) listed are not served" in cli("users").err  # dave is disabled
    assert "4 users (1 disabled)" in cli("validate").out
