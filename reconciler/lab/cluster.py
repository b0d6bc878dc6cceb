"""The cluster file for lab hosts (``reconciler lab up --write``, the demo, tests and benchmarks)."""

from __future__ import annotations

from collections.abc import Sequence

from reconciler.lab.hosts import Host, Lab

PORTS = {"vless-tls": 443, "trojan": 443, "shadowsocks-2022": 8388, "hysteria2": 443, "tuic": 443, "vless-reality": 443}
PROTOCOLS = tuple(PORTS)
USER_NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]


def lab_cluster_yaml(lab: Lab, hosts: Sequence[Host], countries: Sequence[str], protocol: str | Sequence[str] = "vless-tls",
                     prober_index: int | None = None, harden: bool = False, report_interval: float | None = None,
                     listen: str | None = None, extra_settings: Sequence[str] = (), users: int = 2) -> str:
    """A valid cluster file for the lab hosts: one inbound each (protocols cycled), all in one route, host keys pinned."""
    lines = [
        "# yaml-language-server: $schema=schemas/cluster.schema.json",
        "# Written by `reconciler lab up`: sandbox hosts on this machine (198.18.0.0/24 in network namespaces).",
        "settings:",
        "  outputs: {state_dir: .reconciler-lab, subscriptions_dir: subscriptions-lab"
        + (f", listen: \"{listen}\"" if listen else "") + "}",
        f"  harden: {'true' if harden else 'false'}",
        *([f"  health: {{report_interval: {report_interval:g}s}}"] if report_interval else []),
        *(f"  {line}" for line in extra_settings),
        "servers:",
    ]
    protocols = [protocol] if isinstance(protocol, str) else list(protocol)
    for i, h in enumerate(hosts):
        country = countries[i % len(countries)]
        proto = protocols[i % len(protocols)]
        extra = {"vless-reality": "camouflage: www.example.com", "shadowsocks-2022": ""}.get(proto, "tls: {server_name: www.lab.test}")
        lines += [
            f"  - name: {h.name}",
            f"    host: {h.ip}",
            f"    ssh: {{user: root, port: 22, identity: {lab.key}, host_key: \"{lab.host_key(h)}\"}}",
            f"    country: {country}",
            *(["    prober: true"] if i == prober_index else []),
            "    inbounds:",
            f"      - {{id: {h.name}-in, name: \"{country} {h.name}\", protocol: {proto}, port: {PORTS[proto]}, route: lab"
            + (f", {extra}" if extra else "") + "}",
        ]
    names = USER_NAMES + [f"user{i}" for i in range(len(USER_NAMES), users)]
    lines += ["routes:", "  - {id: lab, name: Lab}", "users:", *(f"  - name: {n}" for n in names[:users]), ""]
    return "\n".join(lines)
