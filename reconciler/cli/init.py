"""``init``: scaffold a minimal valid cluster file for the engine of choice (that one file, nothing beside it)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_command, add_file, cluster_file
from reconciler.config.schema import SCHEMA_PATH
from reconciler.errors import InvalidInput

#: What `init` writes for each engine: the official release, fetched by the servers, pinned by `engine pin`.
#: sing-box's is its Arch Linux package: zstd, which a server unpacks through its own libzstd in ~42% of the CPU a
#: .tar.gz costs; it holds upstream's musl build, the one its .deb and .rpm install. Mihomo publishes a .gz only.
INIT_ENGINES = {
    "sing-box": "https://github.com/SagerNet/sing-box/releases/download/v{{version}}/sing-box_{{version}}_linux_{{machine}}.pkg.tar.zst",
    "mihomo": "https://github.com/MetaCubeX/mihomo/releases/download/v{{version}}/mihomo-linux-{{arch}}-v{{version}}.gz",
}

INIT_TEMPLATE = """\
# yaml-language-server: $schema=schemas/cluster.schema.json
# A minimal cluster: one server, one inbound, one route. Next:
#   reconciler engine pin -f {file}   # fetch the engine release once, write its sha256 and capabilities here
#   reconciler validate -f {file}
# Secrets never go here: set RECONCILER_SECRET (`reconciler secret new` makes one; see settings.secret).

settings:
  engine:
    name: {engine}
    version: {version}
    install: download               # each server fetches the official release; the controller uploads where one cannot
    url: "{url}"
  health:
    report_interval: 60s
  outputs:
    listen: 127.0.0.1:8080          # public: /sub/<token> and /healthz (put your https reverse proxy in front)
    public_url: http://127.0.0.1:8080   # where users' apps reach `listen`: your https address in production

servers:
  - name: vps-1
    host: 203.0.113.10              # your server's address
    ssh: {{user: root, port: 22}}
    country: DE                     # ISO 3166-1 alpha-2; the region is derived
    inbounds:
      - id: vps-1-reality
        name: "My VPN"              # what users see in their app
        protocol: vless-reality
        port: 443
        camouflage: www.example.com # a real TLS 1.3 site (a DNS name) REALITY presents to strangers
        route: default

routes:
  - id: default                     # the route a file without routes gets implicitly (ROUTE-6)
    name: default

users:
  - name: me
"""


def register(sub: Any) -> None:
    i = add_command(sub, "init", HELP["init"], "reconciler init -f cluster.yaml")
    add_file(i, positional=True)
    i.add_argument("--force", action="store_true", help="overwrite an existing file")
    i.add_argument("--engine", choices=sorted(INIT_ENGINES), default="sing-box",
                   help="the engine the servers run (both serve REALITY from their official releases; default: sing-box)")
    i.set_defaults(run=cmd_init)


def cmd_init(args: argparse.Namespace) -> int:
    path = Path(cluster_file(args))
    if path.exists() and not args.force:
        raise InvalidInput(f"{path} already exists; use --force to overwrite")
    path.parent.mkdir(parents=True, exist_ok=True)
    from reconciler.model import ENGINE_VERSIONS

    engine = args.engine
    path.write_text(INIT_TEMPLATE.format(file=path, engine=engine, version=ENGINE_VERSIONS[engine],
                                         url=INIT_ENGINES[engine].format()), encoding="utf-8")
    print(f"wrote {path}; next: reconciler engine pin -f {path}, then reconciler validate -f {path}")
    if not (path.parent / SCHEMA_PATH).exists():  # written only when asked: `init` writes the one file it was given
        print(f"editors complete and check it with its schema: cd {path.parent} && reconciler schema")
    return 0
