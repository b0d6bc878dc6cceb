"""The app-like probe (HEALTH-16): what a witness's agent runs besides the handshake. Pure.

A censor may let a handshake through and then stall the flow after some kilobytes, reset on a ClientHello's
server name, or drop UDP: a TCP connect and a TLS handshake (or a QUIC version negotiation) then pass while
every user's app fails. So each witness also runs a real proxy session through each inbound it probes:

- its own engine binary in client mode (the agent stays standard-library only), with one SOCKS listener on the
  witness's loopback per probed inbound, each sent to that inbound with the **probe credential**
  (``reconciler.credentials.probe_credentials``: on every inbound, in no subscription, routed by the servers to
  the probe responder only, never counted as a user's traffic);
- through it, ``GET /pad/<bytes>`` of the target's responder (on the target's loopback), whose answer carries
  ``bytes`` of padding (``settings.health.app_probe_bytes``, 64 KiB by default: past the 15–20 KB after which
  censors stall foreign flows).

Certificates are not verified (as by the handshake probe: reachability, not trust); REALITY uses the inbound's
real public key, since without it there is no session. An inbound the witness's engine cannot dial (REALITY from
a sing-box build without uTLS) and a target whose configuration may not yet hold the probe credential (it has
changes not yet applied) get the handshake probe alone.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from reconciler.credentials import Secret, probe_credentials, reality_keys
from reconciler.engine.base import RESPONDER_HOST, RESPONDER_PORT
from reconciler.model import Cluster, InboundRef
from reconciler.subscriptions.formats import clash_proxy, singbox_outbound
from reconciler.subscriptions.outbound import ClientOutbound, outbound_for

BASE_PORT = 17300  # the witness's loopback SOCKS ports: BASE_PORT + i for the i-th probed inbound
CONFIG_FILE = {"sing-box": "probe.json", "mihomo": "probe.yaml"}
ARGV = {"sing-box": ("run", "-c", "{config}"), "mihomo": ("-d", "{dir}", "-f", "{config}")}


@dataclass(frozen=True)
class AppTarget:
    """One inbound as a witness's client dials it with the probe credential."""

    inbound: str
    outbound: ClientOutbound


def probe_outbound(ref: InboundRef, secret: Secret) -> ClientOutbound:
    """How a witness's client reaches ``ref`` with the probe credential (unverified TLS: reachability, not trust)."""
    ib = ref.inbound
    public_key = reality_keys(secret, ib.id, ib.rotate).public_key if ib.protocol == "vless-reality" else ""
    return outbound_for(ref, ib.id, secret, probe_credentials(secret), public_key, "", unverified=True)


def probe_targets(cluster: Cluster, secret: Secret) -> dict[str, AppTarget]:
    """Every inbound's ``AppTarget``, by inbound id: made once per cluster, shared by every witness's request."""
    return {ref.inbound.id: AppTarget(ref.inbound.id, probe_outbound(ref, secret)) for ref in cluster.inbounds}


def client_config(engine: str, targets: Sequence[AppTarget]) -> str:
    """The witness's client configuration: SOCKS on ``BASE_PORT + i`` → the i-th target, nothing else."""
    if engine == "mihomo":
        doc = {
            "mode": "rule", "log-level": "error", "allow-lan": False, "ipv6": True, "find-process-mode": "off",
            "geo-auto-update": False, "profile": {"store-selected": False, "store-fake-ip": False},
            "listeners": [{"name": f"p{i}", "type": "socks", "listen": "127.0.0.1", "port": BASE_PORT + i, "udp": False,
                           "proxy": f"o{i}"} for i in range(len(targets))],
            "proxies": [clash_proxy(t.outbound, f"o{i}") for i, t in enumerate(targets)],
            "rules": ["MATCH,REJECT"],
        }
        return json.dumps(doc, ensure_ascii=False)  # JSON is YAML 1.2
    doc = {
        "log": {"level": "error"},
        "inbounds": [{"type": "socks", "tag": f"p{i}", "listen": "127.0.0.1", "listen_port": BASE_PORT + i}
                     for i in range(len(targets))],
        "outbounds": [singbox_outbound(t.outbound, f"o{i}") for i, t in enumerate(targets)]
                     + [{"type": "direct", "tag": "direct"}],
        "route": {"rules": [*({"inbound": [f"p{i}"], "outbound": f"o{i}"} for i in range(len(targets))),
                            {"action": "reject"}], "final": "direct"},
    }
    return json.dumps(doc, ensure_ascii=False)


def app_request(engine: str, binary: str, targets: Sequence[AppTarget], nbytes: int,
                timeout: float) -> dict[str, object] | None:
    """The request's ``app`` part for one witness (None: nothing to probe this way)."""
    if not targets or nbytes <= 0:
        return None
    return {"argv": [binary, *ARGV[engine]], "file": CONFIG_FILE[engine], "config": client_config(engine, targets),
            "responder": [RESPONDER_HOST, RESPONDER_PORT], "path": f"/pad/{nbytes}", "bytes": nbytes,
            "timeout": timeout, "ports": {t.inbound: BASE_PORT + i for i, t in enumerate(targets)}}


def dialable(engine: str, protocol: str, lacks: Collection[str]) -> bool:
    """Whether a witness running ``engine`` can dial ``protocol`` (``lacks``: the capabilities its build lacks)."""
    if protocol == "vless-reality":
        return "reality" not in lacks
    if protocol in ("hysteria2", "tuic"):
        return "quic" not in lacks
    return True
