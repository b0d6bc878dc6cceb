"""What every engine adapter gives, and what is the same for all of them (pure).

An engine adapter (``reconciler.engine.singbox``, ``reconciler.engine.mihomo``) is a ``Layout`` — where its
binary, configuration and unit live, how it checks a configuration and tells its version, which process name
owns its ports — and a renderer of the server configuration. Plan and apply read only the ``Layout`` a
``DesiredServer`` carries: nothing outside the adapters names an engine's paths or commands
(``reconciler.engine.adapters.desired`` picks the adapter a server runs).

The same for every engine, here: the files' types (``ManagedFile``: what it holds, which secrets, whether it
is ``opaque``), the TLS files of an inbound (the operator's, or a certificate derived from the master secret:
``reconciler.certificates``), the firewall, and who is an active user.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from reconciler.certificates import derived_certificate
from reconciler.credentials import Redactor, Secret
from reconciler.engine.scripts import spliced
from reconciler.model import Cluster, Server, User, UserUsage
from reconciler.model.roster import ACTIVE, STANDINGS
from reconciler.safe_read import private_paths, read_confined, read_regular_file
from reconciler.text import size_text

AGENT = "/usr/local/lib/reconciler/agent.py"
AGENT_SOURCE = spliced((Path(__file__).with_name("agent.py")).read_text(encoding="utf-8")).encode()  # as installed
# The probe responder (HEALTH-16): on the server's loopback; a probe or an app's health check fetches its padded
# answer through an inbound (``reconciler/engine/responder.py``). Its unit is pulled in by the engine's.
RESPONDER = "/usr/local/lib/reconciler/responder.py"
RESPONDER_SOURCE = (Path(__file__).with_name("responder.py")).read_bytes()
RESPONDER_PORT = 9097
RESPONDER_HOST = "127.0.0.1"
RESPONDER_IDS = "/etc/reconciler/responder.json"  # this server's inbounds as an order names them (``responder.rank_id``)
RESPONDER_SERVICE = "reconciler-responder.service"
RESPONDER_UNIT = f"/etc/systemd/system/{RESPONDER_SERVICE}"
RESPONDER_SOCKET = "reconciler-responder.socket"
RESPONDER_SOCKET_UNIT = f"/etc/systemd/system/{RESPONDER_SOCKET}"
# Socket-activated: systemd holds the listener from the engine's start on, and the responder (a Python start and
# asyncio's import: ~40 ms of a server's CPU) starts at the first probe, not during every apply's restart. Started
# directly (the engine's PartOf restart of a running one), it is handed the same socket; with none (its socket unit
# failed: the port was still held by an older responder), it listens itself.
RESPONDER_UNIT_TEXT = f"""\
# Managed by reconciler: the probe responder (loopback only), started by its socket at the first probe.
[Unit]
Description=reconciler probe responder (managed by reconciler)
PartOf=sing-box.service mihomo.service

[Service]
ExecStart=/usr/bin/python3 -I -S {RESPONDER} {RESPONDER_HOST}:{RESPONDER_PORT}
Restart=on-failure
RestartSec=2s
DynamicUser=yes
MemoryMax=64M
"""
RESPONDER_SOCKET_TEXT = f"""\
# Managed by reconciler: the probe responder's listener (loopback only), pulled in by the proxy engine's unit.
[Unit]
Description=reconciler probe responder listener (managed by reconciler)

[Socket]
ListenStream={RESPONDER_HOST}:{RESPONDER_PORT}
Backlog=1024
"""
CLASH_API = "127.0.0.1:9090"  # every engine's statistics API, on the server's loopback

# Per-user traffic, counted by the kernel: each user's outbound carries SO_MARK ``MARK_BASE | id``;
# the nftables table below copies it to the connection (ct mark) and counts every packet of that connection in
# both directions, per (mark, IP version, transport). The counters live in the kernel, so they count connections
# of any length exactly, survive engine restarts and reloads, and cost no polling; the agent reads them once per
# report interval. Only a reboot (or removing the table) starts them again from zero, which the controller sees.
USAGE_TABLE = "reconciler_usage"
USAGE_NFT = "/etc/reconciler/usage.nft"
#: What every engine's server holds besides the engine (removed with the server): the agent, the responder with
#: its units, the per-user counters' table.
SHARED_FILES = (AGENT, RESPONDER, RESPONDER_IDS, RESPONDER_SOCKET_UNIT, RESPONDER_UNIT, USAGE_NFT)
MARK_BASE, MARK_MASK = 0x5A000000, 0xFF000000
USAGE_NFT_TEXT = f"""# Managed by reconciler: per-user traffic counters (read by the collection agent).
table inet {USAGE_TABLE} {{
  set tx {{ typeof ct mark . meta nfproto . meta l4proto; flags dynamic; size 1048576; }}
  set rx {{ typeof ct mark . meta nfproto . meta l4proto; flags dynamic; size 1048576; }}
  chain out {{
    type filter hook output priority mangle; policy accept;
    meta mark & {MARK_MASK:#x} == {MARK_BASE:#x} ct mark set meta mark
    ct mark & {MARK_MASK:#x} == {MARK_BASE:#x} add @tx {{ ct mark . meta nfproto . meta l4proto counter }}
  }}
  chain in {{
    type filter hook input priority mangle; policy accept;
    ct mark & {MARK_MASK:#x} == {MARK_BASE:#x} add @rx {{ ct mark . meta nfproto . meta l4proto counter }}
  }}
}}
"""
# Loaded before the engine starts (and by the agent when missing), never reloaded over itself: that would zero it.
USAGE_LOAD = (f"/bin/sh -c 'nft list table inet {USAGE_TABLE} >/dev/null 2>&1 || nft -f {USAGE_NFT}'")


def mark_key(secret: Secret) -> bytes:
    """The key of the users' marks: derived from the master secret, so a server, which sees the marks of the users
    in its configuration, cannot compute anyone else's from a name."""
    return secret.derive("usage-mark", length=32)


def usage_marks(cluster: Cluster, key: bytes) -> dict[str, int]:
    return marks_for(tuple(u.name for u in cluster.users), key)


@functools.lru_cache(maxsize=4)
def marks_for(names: tuple[str, ...], key: bytes) -> dict[str, int]:
    """``user_marks``, kept for the last few sets of names (rendering asks per server)."""
    return user_marks(names, key)


def user_marks(names: tuple[str, ...], key: bytes) -> dict[str, int]:
    """user → the SO_MARK of that user's outbound on every server (the one place that decides it).

    24 bits of a keyed hash of the name (``mark_key``), so a user keeps its mark whoever else is added, and a mark
    says nothing to whoever lacks the key; a collision (rare: one in 16 million per pair) moves the later name (in
    sorted order) to the next free value."""
    taken: set[int] = set()
    marks = {}
    for name in sorted(names):
        slot = int.from_bytes(hashlib.blake2b(name.encode(), key=key[:64], digest_size=3).digest(), "big") or 1
        while slot in taken:
            slot = slot % 0xFFFFFF + 1
        taken.add(slot)
        marks[name] = MARK_BASE | slot
    return marks


@dataclass(frozen=True)
class Layout:
    """An engine as plan, apply, facts and collection see it on a server."""

    name: str  # "sing-box", "mihomo"
    binary: str
    config_dir: str
    template: str  # what the controller writes
    config: str  # what the engine runs (the commit renders it from the template)
    unit: str
    check: tuple[str, ...]  # argv; "{binary}", "{config}" and "{dir}" expand
    version_args: tuple[str, ...]  # argv after the binary that prints its version
    reloads: bool  # SIGHUP re-reads the configuration (else a change restarts it)

    @property
    def service(self) -> str:
        return os.path.basename(self.unit)

    @property
    def wants(self) -> str:
        """What `systemctl enable` links (WantedBy=multi-user.target)."""
        return f"/etc/systemd/system/multi-user.target.wants/{self.service}"

    @property
    def process(self) -> str:
        """The process name `ss` shows for its sockets."""
        return os.path.basename(self.binary)

    @property
    def tls_dir(self) -> str:
        return f"{self.config_dir}/tls"

    def check_argv(self, binary: str, config: str) -> list[str]:
        return [a.format(binary=binary, config=config, dir=self.config_dir) for a in self.check]

    def paths(self) -> tuple[str, ...]:
        """Everything of this engine a removal takes away."""
        return (self.template, self.config, self.unit, self.binary)


def unit_text(description: str, *service: str) -> str:
    """An engine's systemd unit: ``service`` lines (how it starts) and what every engine shares (reload by SIGHUP,
    restart on failure, file limit)."""
    # The responder's digest: a new responder restarts the engine, and with it (PartOf) the responder.
    responder = hashlib.sha256(RESPONDER_SOURCE + RESPONDER_UNIT_TEXT.encode() + RESPONDER_SOCKET_TEXT.encode()).hexdigest()[:12]
    lines = [
        "# Managed by reconciler: edits here are drift and will be corrected.", f"# probe responder {responder}", "[Unit]",
        f"Description={description} (managed by reconciler)", "After=network-online.target",
        f"Wants=network-online.target {RESPONDER_SOCKET}", "", "[Service]", f"ExecStartPre=-{USAGE_LOAD}", *service,
        "ExecReload=/bin/kill -HUP $MAINPID",
        "Restart=on-failure", "RestartSec=2s", "LimitNOFILE=1048576", "", "[Install]", "WantedBy=multi-user.target",
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ManagedFile:
    """A file the server must hold. ``repr`` shows neither its content nor its secrets."""

    path: str
    content: bytes = field(repr=False)
    mode: int = 0o644
    secret: bool = False  # holds credentials: diffs show every credential as its fingerprint
    engine: bool = True  # a change reloads the engine (the collection agent's does not)
    opaque: bool = False  # key material or a certificate: never diffed, only fingerprinted
    summary: bool = False  # generated by us (the agent): a change is one line, not a diff of its source
    secrets: tuple[str, ...] = field(default=(), repr=False)  # the exact secret values put into ``content``

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()


@dataclass(frozen=True)
class EngineBinary:
    version: str
    sha256: str | None  # upload: of the binary; download: of the release file, for the server's architecture
    local_path: str | None  # upload from here
    url: str | None  # or download from here on the server ({version} expanded; {arch}, {machine} per server)
    sha256_by_arch: tuple[tuple[str, str], ...] = ()  # download: (arch, sha256) pins

    def pin_for(self, arch: str) -> str | None:
        return dict(self.sha256_by_arch).get(arch, self.sha256 if not self.sha256_by_arch else None)


@dataclass(frozen=True)
class DesiredServer:
    server: str
    engine: Layout
    files: tuple[ManagedFile, ...]
    binary: EngineBinary
    listeners: tuple[tuple[int, str], ...]  # (port, tcp|udp) that must be listening after apply
    firewall: tuple[ManagedFile, ...] = field(default_factory=tuple)  # harden: rules and their boot unit
    retire: tuple[Layout, ...] = ()  # the other engines: stopped and removed where found
    withheld: tuple[tuple[str, str], ...] = ()  # (user, why) of the users its configuration leaves out

    def digest(self) -> str:
        h = hashlib.sha256(f"engine\0{self.engine.name}\n".encode())
        for f in sorted(self.files, key=lambda f: f.path):
            h.update(f"{f.path}\0{f.mode:o}\0{f.sha256}\n".encode())
        for f in self.firewall:
            h.update(f"fw\0{f.path}\0{f.sha256}\n".encode())
        h.update(f"bin\0{self.binary.version}\0{self.binary.sha256}\0{self.binary.sha256_by_arch}\n".encode())
        return h.hexdigest()

    def redactor(self) -> Redactor:
        """What text about this server passes through before a person sees it: its files' secrets become
        fingerprints (and any PEM block does)."""
        return Redactor.of(v for f in (*self.files, *self.firewall) for v in f.secrets)


def torrent_blocked(cluster: Cluster, server: Server) -> list[str]:
    """The server's inbounds whose route refuses BitTorrent (``routes[].block_torrent``)."""
    blocking = {r.id for r in cluster.effective_routes if r.block_torrent}
    return [ib.id for ib in server.inbounds if cluster.route_of(ib.id) in blocking]


def withheld_users(cluster: Cluster, now: float, usage: Mapping[str, UserUsage] | None = None) -> list[tuple[str, str]]:
    """(user, why in the operator's words) for every user the servers refuse at ``now`` (the plan shows them)."""
    usage = usage or {}
    out = []
    codes = cluster.roster.standings(now, usage)
    for i in np.flatnonzero(codes != ACTIVE).tolist():
        u = cluster.users[i]
        used = usage.get(u.name)
        standing = STANDINGS[codes[i]]
        if standing == "disabled":
            out.append((u.name, "disabled"))
        elif standing == "expired":
            out.append((u.name, f"expired {datetime.fromtimestamp(u.expires_at or now, UTC):%Y-%m-%d %H:%M} UTC"))
        elif standing == "over_quota" and used is not None:
            back = f", resets {datetime.fromtimestamp(used.next_reset, UTC):%Y-%m-%d}" if used.next_reset else ""
            out.append((u.name, f"over quota: {size_text(used.used)} of {size_text(u.data_limit or 0)}{back}"))
        elif standing == "device_limit" and used is not None:
            out.append((u.name, f"{used.devices} devices, the limit is {u.device_limit}"))
    return out


def active_users(cluster: Cluster, now: float, usage: Mapping[str, UserUsage] | None = None) -> list[User]:
    """The users whose credentials the servers accept at ``now`` with what the fleet measured (``roster.standings``
    decides: an expired, disabled or over-quota user is left out of every server's configuration)."""
    users = cluster.users
    return [users[i] for i in np.flatnonzero(cluster.roster.standings(now, usage) == ACTIVE).tolist()]


ACME_FOLDER = "acme"  # in the state folder: the ACME account key and the certificates it was issued


def acme_paths(acme_dir: str, inbound_id: str) -> tuple[str, str]:
    """Where the controller keeps an inbound's ACME certificate (chain) and key."""
    return os.path.join(acme_dir, f"{inbound_id}.crt"), os.path.join(acme_dir, f"{inbound_id}.key")


def tls_files(server: Server, secret: Secret, layout: Layout, base_dir: str, acme_dir: str,
              private: tuple[str, ...] = ()) -> list[ManagedFile]:
    """Every TLS inbound's certificate and key at ``<tls_dir>/<inbound>.crt|.key``: the operator's files, read
    here from the repository or a folder the operator allows (``safe_read.read_confined``); the ACME CA's, as the
    controller last got them (``acme_dir``); or a certificate derived from the master secret. Both opaque: a
    certificate is public, but its diff is noise and its PEM is never printed; a key's lines are secrets too (a tool
    that echoes one line of it shows its fingerprint)."""
    files = []
    for ib in server.inbounds:
        tls = getattr(ib, "tls", None)
        if tls is None:
            continue  # REALITY's key is in the configuration; Shadowsocks has no TLS
        if tls.certificate and tls.key:  # the model gives both or neither
            # Only from the repository (``base_dir``) or a folder the operator allows, checked again on the opened
            # file: the cluster file may come from a pull request, and these files go to the server.
            # Never one of the controller's own files (``private``: Cluster.controller_private), such as another
            # inbound's ACME key in the state folder.
            mine = private_paths(private, base_dir)
            cert = read_confined(tls.certificate, base_dir, private=mine)
            key = read_confined(tls.key, base_dir, private=mine)
        elif tls.acme:
            cert_path, key_path = acme_paths(acme_dir, ib.id)
            try:
                cert, key = read_regular_file(cert_path), read_regular_file(key_path)
            except FileNotFoundError:
                # Until the CA's certificate is had (apply orders it first), the derived one holds the place: the
                # engine and the firewall (which opens the CA's HTTP-01 port) are in place for the next order.
                made = derived_certificate(secret, ib.id, tls.server_name, tls.rotate)
                cert, key = made.cert_pem.encode(), made.key_pem.encode()
        else:
            made = derived_certificate(secret, ib.id, tls.server_name, tls.rotate)
            cert, key = made.cert_pem.encode(), made.key_pem.encode()
        lines = tuple(x for x in key.decode(errors="replace").splitlines() if len(x) >= 16 and not x.startswith("-----"))
        files += [ManagedFile(f"{layout.tls_dir}/{ib.id}.crt", cert, 0o644, opaque=True),
                  ManagedFile(f"{layout.tls_dir}/{ib.id}.key", key, 0o600, secret=True, opaque=True, secrets=lines)]
    return files


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


def firewall_files(cluster: Cluster, server: Server, listeners: list[tuple[int, str]]) -> tuple[ManagedFile, ...]:
    if not cluster.settings.harden:
        return ()
    if any(getattr(getattr(ib, "tls", None), "acme", False) for ib in server.inbounds):
        listeners = [*listeners, (cluster.settings.acme.http_port, "tcp")]  # the CA's HTTP-01 requests
    return (ManagedFile(FIREWALL, firewall_rules(server.ssh.port, listeners).encode(), 0o644),
            ManagedFile(FIREWALL_UNIT, FIREWALL_UNIT_TEXT.encode(), 0o644))
