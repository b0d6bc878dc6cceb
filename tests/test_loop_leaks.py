"""Nothing the loop shows a person or a scraper carries a secret: its logs, /metrics, /status.json,
the status page and /healthz hold neither the master secret nor any credential derived from it,
nor a PEM block. (The subscription documents carry credentials by design and are not scanned.)"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp

from reconciler.config import load_cluster
from reconciler.credentials import Secret, clash_api_secret, ss_server_key, user_credentials
from reconciler.fleet import parse_report
from reconciler.lab.demo import free_port
from reconciler.loop import service
from reconciler.loop.service import Loop
from reconciler.model import Cluster
from tests.test_fleet import SECRET, cluster_text, reports


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
    loop = Loop(str(path), cluster, secret, listen=listen, operations_listen=ops, watch=False)
    clock = {"now": time.time() - 100}

    async def collect(c: Cluster) -> dict[str, object]:
        got: dict[str, object] = reports(c, clock["now"], loop._tick_index)
        # One server answers garbage that quotes its own request back (as a broken agent might).
        got["de-1"] = None
        bad = json.dumps({"service": "active", "probes": {"x": {"ok": "yes"}}, "echo": clash_api_secret(secret, "de-1")})
        try:
            parse_report("de-1", bad, clock["now"])
        except Exception as exc:  # noqa: BLE001 — logged as the loop would
            logging.getLogger("reconciler.loop").warning("de-1: no report this interval: %s", exc)
        return got

    loop.collect = collect  # type: ignore[method-assign]
    real_time = service.time.time

    async def go() -> list[str]:
        service.time.time = lambda: clock["now"]  # type: ignore[attr-defined]
        try:
            for _ in range(10):
                clock["now"] += 10
                await loop.tick()
        finally:
            service.time.time = real_time  # type: ignore[attr-defined]
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
    for value in secrets_of(cluster, secret):
        assert value not in shown
    assert "-----BEGIN" not in shown
