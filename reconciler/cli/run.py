"""``run``: the reconcile loop (GITOPS-5) and ``simulate``: a health scenario replayed (HEALTH-1..13)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from reconciler.cli.commands import HELP
from reconciler.cli.common import add_allow_path, add_command, add_file, cluster_file, print_diagnostics, secret_of
from reconciler.config import load_cluster, load_document
from reconciler.config.diagnostics import at
from reconciler.errors import ConfigError
from reconciler.model.cluster import HealthSettings
from reconciler.model.types import parse_listen
from reconciler.servable import servable
from reconciler.text import PrintableFormatter


def register(sub: Any) -> None:
    rn = add_command(sub, "run", HELP["run"],
                     "reconciler run -f cluster.yaml --listen 127.0.0.1:8080",
                     description="The reconcile loop: collect, verdicts, outlets, drift correction (GITOPS-5). With "
                                 "settings.leader.etcd, several controllers run it: one leads, the others stand by and "
                                 "serve subscriptions from its published state (docs/standby.md).")
    add_file(rn)
    rn.add_argument("--listen", type=_address, help="public HTTP address HOST:PORT (default: settings.outputs.listen)")
    rn.add_argument("--operations-listen", type=_address,
                    help="operations HTTP address HOST:PORT: metrics, status (default: settings.outputs.operations_listen)")
    rn.add_argument("--duration", type=float, help="stop after this many seconds (tests, demos)")
    rn.add_argument("--ticks", type=int, help="stop after this many intervals")
    rn.add_argument("--no-watch", action="store_true", help="do not watch the file for changes")
    rn.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="how much to log")
    rn.set_defaults(run=cmd_run)

    sim = add_command(sub, "simulate", HELP["simulate"], "reconciler simulate --example block")
    source = sim.add_mutually_exclusive_group(required=True)
    source.add_argument("scenario", nargs="?", help="the scenario file (YAML)")
    source.add_argument("--example", choices=example_scenarios(), metavar="NAME",
                        help="a scenario shipped with the reconciler: " + ", ".join(example_scenarios()))
    sim.add_argument("--json", action="store_true", help="one JSON object per line per tick")
    sim.add_argument("--all", action="store_true", help="table: every server every tick, not only changes")
    add_allow_path(sim)  # the scenario's cluster file names files too
    sim.set_defaults(run=cmd_simulate)


def _address(text: str) -> str:
    try:
        parse_listen(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(PrintableFormatter("%(asctime)s %(levelname)-7s %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.WARNING)  # etcd3gw's HTTP client (settings.leader), one line per request


def cmd_run(args: argparse.Namespace) -> int:
    from reconciler.loop.service import run_loop  # aiohttp, asyncssh, prometheus: only for this command

    setup_logging(args.log_level)
    path = cluster_file(args)
    cluster = servable(path, migrate_users=True)  # what plan refuses is not served either; a users' schema migrated
    coro = run_loop(path, cluster, secret_of(cluster), listen=args.listen, operations_listen=args.operations_listen,
                    duration=args.duration, max_ticks=args.ticks, watch=not args.no_watch)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def example_scenarios() -> list[str]:
    """The scenarios shipped in the package (``reconciler/health/examples``), by name."""
    from importlib import resources

    folder = resources.files("reconciler.health") / "examples"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def cmd_simulate(args: argparse.Namespace) -> int:
    from reconciler.health.simulate import Scenario, check_expectations, check_names, expectations, inline_topology, run
    from reconciler.health.topology import Topology

    if args.example:
        from importlib import resources

        args.scenario = str(resources.files("reconciler.health") / "examples" / f"{args.example}.yaml")
    scenario, diagnostics, source = load_document(args.scenario, Scenario)
    if scenario is None:
        raise ConfigError(f"{args.scenario}: invalid scenario", diagnostics)
    settings = scenario.health or HealthSettings()
    if scenario.cluster is not None:
        cluster_path = os.path.join(os.path.dirname(os.path.abspath(args.scenario)), scenario.cluster)
        loaded = load_cluster(cluster_path, display=os.path.join(os.path.dirname(args.scenario), scenario.cluster))
        if loaded.cluster is None:
            raise ConfigError(f"{scenario.cluster}: invalid cluster file", loaded.errors)
        topology = Topology.from_cluster(loaded.cluster)
        settings = scenario.health or loaded.cluster.settings.health
    else:
        topology = inline_topology(scenario.servers or [])
    hint = f"known servers: {', '.join(topology.servers)}"
    problems = [at("error", source.key(("events", i)), msg, hint, "reference") for i, msg in check_names(scenario, topology)]
    problems += [at("error", source.key(("expect", i)), msg, hint, "reference")
                 for i, msg in check_expectations(scenario, topology)]
    if problems:
        print_diagnostics(problems)
        return 1
    if args.json:
        import json

        for tick, verdicts in run(scenario, topology, settings):
            line = {"tick": tick, "servers": {name: v.as_json() for name, v in verdicts.servers().items()}}
            print(json.dumps(line, ensure_ascii=False))
    else:
        from reconciler.cli.timeline import print_timeline

        print_timeline(scenario, topology, settings, args.all)
    if not scenario.expect:
        return 0
    missed = expectations(scenario, topology, settings)
    if missed:
        print_diagnostics([at("error", source.key(("expect", i)), f"expectation not met: {msg}", None, "expectation")
                           for i, msg in missed])
        return 1
    print(f"{len(scenario.expect)} expectation(s) met", file=sys.stderr)
    return 0
