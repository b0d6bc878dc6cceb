"""Nothing the loop shows a person or a scraper carries a secret: its logs, /metrics, /status.json,
the status page and /healthz hold neither the master secret nor any credential derived from it,
nor a PEM block. (The subscription documents carry credentials by design and are not scanned.)"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from reconciler.config import load_cluster
from reconciler.credentials import Secret, clash_api_secret, ss_server_key, user_credentials
from reconciler.lab.demo import free_port
from reconciler.loop.clock import FakeClock
from reconciler.loop.service import Loop
from reconciler.model import Cluster
from reconciler.ssh.fake import FakeRunner
from tests.fake_agents import answering, install_agent
from tests.test_fleet import SECRET, cluster_text


def secrets_of(cluster: Cluster, secret: Secret) -> set[str]:
    out = {secret.value.decode()}
    for u in cluster.users:
        c = user_credentials(secret, u.name, u.rotate)
        out |= {v for v in vars(c).values() if isinstance(v, str) and len(v) >= 8}
    for s in cluster.servers:
        out.add(clash_api_secret(secret, s.name))
        for ib in s.inbounds:
            if ib.protocol == "shadowsocks-2022":
                out.add(ss_server_key(secret, ib.id, ib.method))
    return out


def test_logs_metrics_and_pages_carry_no_secret(tmp_path, caplog):
    listen, ops = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    path = tmp_path / "cluster.yaml"
    path.write_text(cluster_text(10.0, listen))
    cluster = load_cluster(str(path)).cluster
    assert cluster is not None
    secret = Secret(SECRET.encode())
    # The real collection, through a runner whose hosts answer with installed agents; time moves when told.
    runner = FakeRunner(tmp_path / "hosts")
    for s in cluster.servers:
        install_agent(runner, s.name)
    # One server's agent answers garbage that quotes its own request back (as a broken agent might), another fails
    # and says its request on stderr, which the loop logs.
    install_agent(runner, "de-1", answering({"service": "active", "probes": {"x": {"ok": "yes"}},
                                             "echo": clash_api_secret(secret, "de-1")}))
    install_agent(runner, "de-2", "import json, sys\nreq = json.load(sys.stdin)\n"
                                  "sys.stderr.write('bad request: ' + req['clash_secret'])\nsys.exit(1)\n")
    install_agent(runner, "nl-1", "import json, sys\nreq = json.load(sys.stdin)\nprint('not json ' + req['clash_secret'])\n")
    clock = FakeClock(start=time.time() - 100)
    loop = Loop(str(path), cluster, secret, listen=listen, operations_listen=ops, watch=False, runner=runner, clock=clock)

    async def go() -> list[str]:
        for _ in range(10):
            clock.advance(10)
            await loop.tick()
        host, port = listen.rsplit(":", 1)
        ohost, oport = ops.rsplit(":", 1)
        await loop.http.start(host, int(port), operations=(ohost, int(oport)))
        try:
            texts = []
            async with aiohttp.ClientSession() as http:
                for url in (f"http://{ops}/metrics", f"http://{ops}/status.json", f"http://{ops}/", f"http://{ops}/healthz",
                            f"http://{listen}/healthz", f"http://{listen}/metrics", f"http://{listen}/sub/../../etc/passwd"):
                    async with http.get(url) as resp:
                        texts.append(await resp.text())
            return texts
        finally:
            await loop.http.stop()

    with caplog.at_level(logging.DEBUG):
        pages = asyncio.run(go())
    shown = "\n".join(pages) + "\n" + "\n".join(r.getMessage() + str(r.exc_info or "") for r in caplog.records)
    assert "reconciler_server_status" in shown and "de-2" in shown  # the scan looked at real pages
    # The broken agent's answer reached the loop's own log line (and was refused there), not a copy of it.
    assert any(r.name.startswith("reconciler") and "de-2: no report this interval: the agent exited 1" in r.getMessage()
               for r in caplog.records)
    for value in secrets_of(cluster, secret):
        assert value not in shown
    assert "-----BEGIN" not in shown
