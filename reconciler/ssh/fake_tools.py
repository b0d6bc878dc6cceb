"""The fake host's stand-ins for ``systemctl``, ``ss``, ``nft`` and the engines (standard library only).

``reconciler.ssh.fake`` copies this file, behind a ``#!python`` line, into a fake host's ``bin`` folder
under each tool's name (and as the engine binary it uploads); the real server-side scripts then call them
as they would call the real tools. The tool is chosen by the name it was started as; its state is the
JSON file ``.fake/state.json`` under the host's root (``FAKE_HOST_ROOT``).

Why fakes: a test needs no root, starts no daemon and opens no socket, and a whole apply runs in a few
hundred milliseconds. What they model: units that are active, failed or inactive and enabled or not (the
wants link), the listeners an engine "opens" (written to ``/proc/net/{tcp,udp}`` under the root, which the
commit's verify step reads), an nftables table, and an engine whose ``check`` or start can be made to
fail (``fail_check_if`` / ``fail_start_if``: a text the configuration contains). tests/lab/ covers the
real tools on real systemd hosts.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

ENGINE_VERSION = "1.14.4"  # the fake engine's answer to `version` (``fake.fake_engine`` sets it)
PIDS = {"sing-box": 4242, "mihomo": 4243}  # each engine's process
UDP_TYPES = {"hysteria2", "tuic"}


def root() -> str:
    return os.environ.get("FAKE_HOST_ROOT", "/nonexistent")


def at(path: str) -> str:
    return root().rstrip("/") + path


def load() -> dict[str, Any]:
    try:
        with open(at("/.fake/state.json")) as f:
            state: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        state = {}
    state.setdefault("units", {})
    state.setdefault("log", [])
    return state


def save(state: dict[str, Any]) -> None:
    tmp = at(f"/.fake/state.json.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1, sort_keys=True)
    os.replace(tmp, at("/.fake/state.json"))


def unit_file(name: str) -> str:
    return at(f"/etc/systemd/system/{name}")


def wants(name: str) -> str:
    return at(f"/etc/systemd/system/multi-user.target.wants/{name}")


def write_listeners(listeners: list[tuple[int, str]]) -> None:
    """The kernel's socket tables as /proc/net/{tcp,udp} show them: LISTEN is 0A, unconnected UDP 07."""
    os.makedirs(at("/proc/net"), exist_ok=True)
    for proto, state in (("tcp", "0A"), ("udp", "07")):
        lines = ["  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"]
        for i, (port, _proto) in enumerate(sorted(x for x in listeners if x[1] == proto)):
            lines.append(f"{i:4d}: 00000000:{port:04X} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000"
                         "     0        0 1 1 0000000000000000 100 0 0 10 0")
        with open(at(f"/proc/net/{proto}"), "w") as f:
            f.write("\n".join(lines) + "\n")


def start(state: dict[str, Any], name: str) -> None:
    """Start a unit as systemd would: the engine's unit runs ExecStart's binary with its configuration."""
    unit: dict[str, Any] = state["units"].setdefault(name, {})
    unit["starts"] = unit.get("starts", 0) + 1
    if not os.path.exists(unit_file(name)):
        unit["active"] = "failed"
        return
    with open(unit_file(name)) as f:
        exec_start = next((line.split("=", 1)[1].split() for line in f if line.startswith("ExecStart=")), [])
    if not exec_start or os.path.basename(exec_start[0]) not in PIDS:
        unit["active"] = "active"  # a oneshot (the firewall's boot unit)
        return
    binary = exec_start[0]
    engine = os.path.basename(binary)
    config = exec_start[exec_start.index("-c" if "-c" in exec_start else "-f") + 1]
    listeners: list[tuple[int, str]] = []
    try:
        with open(at(config)) as f:
            text = f.read()
        doc = json.loads(text)
        ok = os.access(at(binary), os.X_OK) and not (state.get("fail_start_if") is not None and state["fail_start_if"] in text)
        for ib in doc.get("inbounds", doc.get("listeners", [])):  # sing-box's inbounds, Mihomo's listeners
            kind, port = ib.get("type"), int(ib.get("listen_port", ib.get("port")))
            if kind in UDP_TYPES or kind == "shadowsocks":
                listeners.append((port, "udp"))
            if kind not in UDP_TYPES:
                listeners.append((port, "tcp"))
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    unit["active"] = "active" if ok else "failed"
    unit["listeners"] = listeners if ok else []
    unit["engine"] = engine
    if engine in PIDS:
        write_listeners([x for u in state["units"].values() for x in u.get("listeners", [])])
        os.makedirs(at(f"/proc/{PIDS[engine]}"), exist_ok=True)
        with open(at(f"/proc/{PIDS[engine]}/cgroup"), "w") as f:
            f.write(f"0::/system.slice/{name}\n" if ok else "0::/\n")


def stop(state: dict[str, Any], name: str) -> None:
    unit: dict[str, Any] = state["units"].setdefault(name, {})
    unit["active"], unit["listeners"] = "inactive", []
    write_listeners([x for u in state["units"].values() for x in u.get("listeners", [])])


def _show(state: dict[str, Any], flags: list[str], names: list[str]) -> int:
    props = next(f.split("=", 1)[1] for f in flags if f.startswith("--property=")).split(",")
    unit = state["units"].get(names[0], {})
    loaded = os.path.exists(unit_file(names[0]))
    active = unit.get("active", "inactive")
    values = {"LoadState": "loaded" if loaded else "not-found", "ActiveState": active,
              "SubState": {"active": "running", "failed": "failed"}.get(active, "dead"),
              "UnitFileState": "enabled" if os.path.islink(wants(names[0])) else ("disabled" if loaded else ""),
              "NeedDaemonReload": "no"}
    print("\n".join(f"{p}={values.get(p, '')}" for p in props))
    return 0


def _is_active(state: dict[str, Any], flags: list[str], names: list[str]) -> int:
    active = state["units"].get(names[0], {}).get("active", "inactive")
    print(active)
    return 0 if active == "active" else 3


def _daemon_reload(state: dict[str, Any], flags: list[str], names: list[str]) -> int:
    state["daemon_reloads"] = state.get("daemon_reloads", 0) + 1
    return 0


def _enable(state: dict[str, Any], flags: list[str], names: list[str]) -> int:
    code = 0
    for name in names:
        if not os.path.exists(unit_file(name)):
            print(f"Failed to enable unit: Unit file {name} does not exist.", file=sys.stderr)
            code = 1
        elif not os.path.islink(wants(name)):
            os.makedirs(os.path.dirname(wants(name)), exist_ok=True)
            os.symlink(f"/etc/systemd/system/{name}", wants(name))
        if "--now" in flags and code == 0:
            start(state, name)
    return code


def _disable(state: dict[str, Any], flags: list[str], names: list[str]) -> int:
    for name in names:
        if os.path.islink(wants(name)):
            os.remove(wants(name))
        if "--now" in flags:
            stop(state, name)
    return 0


def _restart(state: dict[str, Any], flags: list[str], names: list[str]) -> int:
    code = 0
    for name in names:
        start(state, name)
        code = code or (0 if state["units"][name]["active"] == "active" else 1)
    return code


def _reload(state: dict[str, Any], flags: list[str], names: list[str]) -> int:
    code = 0
    for name in names:
        if state["units"].get(name, {}).get("active") != "active":
            print(f"Job for {name} failed: not active, cannot reload.", file=sys.stderr)
            code = 1
        else:
            start(state, name)  # the engine re-reads its configuration on SIGHUP
    return code


def _stop(state: dict[str, Any], flags: list[str], names: list[str]) -> int:
    for name in names:
        stop(state, name)
    return 0


# The verbs the fake models: each changes the state and answers systemctl's exit code.
VERBS: dict[str, Callable[[dict[str, Any], list[str], list[str]], int]] = {
    "show": _show, "is-active": _is_active, "daemon-reload": _daemon_reload, "enable": _enable, "disable": _disable,
    "start": _restart, "restart": _restart, "reload": _reload, "stop": _stop,
}


def systemctl(args: list[str]) -> int:
    state = load()
    state["log"].append(" ".join(args))
    flags = [a for a in args if a.startswith("--")]
    words = [a for a in args if not a.startswith("--")]
    verb, names = words[0], words[1:]
    if verb in VERBS:
        code = VERBS[verb](state, flags, names)
    else:
        print(f"fake systemctl: {verb} is not modelled", file=sys.stderr)
        code = 1
    save(state)
    return code


def ss(args: list[str]) -> int:
    for unit in load()["units"].values():
        engine = unit.get("engine", "sing-box")
        for port, proto in unit.get("listeners", []):
            state = "LISTEN" if proto == "tcp" else "UNCONN"
            print(f"{proto}   {state} 0      4096   *:{port}   *:*    users:((\"{engine}\",pid={PIDS.get(engine, 1)},fd=7))")
    return 0


def nft(args: list[str]) -> int:
    state = load()
    if args[:1] == ["list"]:
        if state.get("nft") is None:
            print("Error: No such file or directory", file=sys.stderr)
            return 1
        print(state["nft"], end="")
        return 0
    if args[:1] == ["delete"]:
        state["nft"] = None
    elif args[:1] == ["-f"]:
        if args[1] == "-":
            text = sys.stdin.read()
        else:
            with open(args[1]) as f:
                text = f.read()
        if "table inet reconciler" not in text:
            print("Error: syntax error", file=sys.stderr)
            return 1
        state["nft"] = text
    save(state)
    return 0


def check(path: str) -> int:
    with open(path) as f:
        text = f.read()
    fail = load().get("fail_check_if")
    try:
        json.loads(text)
    except ValueError as exc:
        print(f"FATAL decode config: {exc}", file=sys.stderr)
        return 1
    if fail is not None and fail in text:
        print(f"FATAL[0000] the fake engine rejects a configuration containing {fail!r}", file=sys.stderr)
        return 1
    return 0


def engine(args: list[str]) -> int:
    if args[:1] == ["version"]:
        print(f"sing-box version {ENGINE_VERSION}\n\nEnvironment: fake (reconciler.ssh.fake_tools)")
        return 0
    if args[:2] == ["check", "-c"]:
        return check(args[2])
    print(f"fake sing-box: {' '.join(args)} is not modelled", file=sys.stderr)
    return 1


def mihomo(args: list[str]) -> int:
    if args[:1] == ["-v"]:
        print(f"Mihomo Meta v{ENGINE_VERSION} linux amd64 with go1.26 (fake: reconciler.ssh.fake_tools)")
        return 0
    if args[:1] == ["-t"] and "-f" in args:
        code = check(args[args.index("-f") + 1])
        print("configuration file test is successful" if code == 0 else "configuration file test failed")
        return code
    print(f"fake mihomo: {' '.join(args)} is not modelled", file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    name = os.path.basename(argv[0])
    if name.startswith("sing-box"):
        return engine(argv[1:])
    if name.startswith("mihomo"):
        return mihomo(argv[1:])
    tools = {"systemctl": systemctl, "ss": ss, "nft": nft}
    return tools[name](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
