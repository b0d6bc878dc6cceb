"""One check of what can be served (GITOPS-2): ``validate``, ``plan``, ``apply``, ``run`` and the loop's reload all
refuse what the engines cannot serve, with the same diagnostics; the loop keeps the last good file."""

from __future__ import annotations

import asyncio
import logging

from reconciler.credentials import Secret
from reconciler.loop.service import Loop
from reconciler.servable import load_servable, servable

SECRET = Secret(b"servable-test-secret-0123456789abcdef")


def shadowsocks_on_mihomo(tmp_path) -> tuple[str, str]:
    """A file both engines serve, and the same file on Mihomo, which cannot serve Shadowsocks-2022 with a key per user."""
    good = ("settings:\n  harden: false\n  outputs: {listen: '127.0.0.1:18080'}\n"
            "servers:\n  - name: a\n    host: 198.18.0.10\n    country: DE\n    inbounds:\n"
            "      - {id: a-ss, name: S, protocol: shadowsocks-2022, port: 8388, route: r}\n"
            "routes:\n  - {id: r, name: R}\nusers:\n  - name: alice\n")
    bad = good.replace("  harden: false\n", "  harden: false\n  engine: {name: mihomo}\n")
    return good, bad


def test_the_loop_does_not_adopt_a_file_plan_refuses_and_says_why(tmp_path, caplog):
    # spec: GITOPS-2 — a reload the engines cannot serve is refused like `plan` refuses it; the last good file stays
    path = tmp_path / "cluster.yaml"
    good, bad = shadowsocks_on_mihomo(tmp_path)
    path.write_text(good)
    cluster = servable(str(path))
    loop = Loop(str(path), cluster, SECRET, listen="127.0.0.1:0", watch=False)
    path.write_text(bad)
    refused = load_servable(str(path))
    assert refused.cluster is not None and [d.code for d in refused.errors] == ["engine-capability"]
    with caplog.at_level(logging.ERROR, logger="reconciler"):
        adopted = asyncio.run(loop.reload())
    assert adopted is False and loop.cluster is cluster
    text = caplog.text
    assert refused.errors[0].message in text and "plan and apply refuse it too" in text
    assert "keeping the last good version" in text
    path.write_text(good.replace("name: alice", "name: bob"))  # a servable change is adopted again
    assert asyncio.run(loop.reload()) is True and loop.cluster.users[0].name == "bob"


def test_run_refuses_to_start_on_a_file_plan_refuses(cli, tmp_path, monkeypatch):
    # spec: GITOPS-2 — `run` starts only on a file `plan` would accept, with validate's diagnostics
    monkeypatch.setenv("RECONCILER_SECRET", "servable-test-secret-0123456789abcdef")
    path = tmp_path / "cluster.yaml"
    path.write_text(shadowsocks_on_mihomo(tmp_path)[1])
    line = path.read_text().splitlines().index(next(x for x in path.read_text().splitlines() if "a-ss" in x)) + 1
    validate = cli("validate", "-f", str(path))
    assert validate.rc == 1 and f"{path}:{line}:" in validate.err and "error:" in validate.err, validate.text
    run = cli("run", "-f", str(path), "--ticks", "1")
    assert run.rc == 1, run.text
    assert [x for x in run.err.splitlines() if x.startswith(str(path))] == \
        [x for x in validate.err.splitlines() if x.startswith(str(path)) and ": error:" in x]
