"""Raw observations of one server as JSON (run at every observation; ``reconciler.plan.facts`` parses).

Hashes of managed files, the engine's ``version`` output, the unit's state, ``ss`` listening sockets,
generated public material, the apply lock. The server side stays dumb: the controller decides.

It starts lean: no json, subprocess, hashlib or platform imports (together ~35 ms of a small VPS's CPU,
more than the work itself). The request is spliced in by the runner as a Python literal (``REQUEST``)
and the answer is written as JSON by hand (``enc``).
"""

from __future__ import annotations

import os
import sys

from reconciler.engine.scripts.prelude import UNIT_CGROUPS, at, run  # spliced in when sent

TYPE_CHECKING = False  # typing is not imported on the servers: mypy alone reads these imports
if TYPE_CHECKING:
    from hashlib import sha256
    from typing import Any
else:
    try:
        from _sha256 import sha256  # built in: no OpenSSL to load
    except ImportError:
        try:
            from _sha2 import sha256
        except ImportError:
            from hashlib import sha256

REQUEST: Any = None

ESC = {34: '\\"', 92: "\\\\", **{i: "\\u%04x" % i for i in range(32)}}


def enc(v: Any) -> str:
    """JSON of None, booleans, ints, strings, dicts and lists (what this script emits), without json."""
    if v is None or v is True or v is False:
        return {None: "null", True: "true", False: "false"}[v]
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return '"' + v.translate(ESC) + '"'
    if isinstance(v, dict):
        return "{" + ",".join(enc(k) + ":" + enc(x) for k, x in v.items()) + "}"
    return "[" + ",".join(enc(x) for x in v) + "]"


def sha(p: str) -> str | None:
    try:
        with open(p, "rb") as f:
            return str(sha256(f.read()).hexdigest())
    except OSError:
        return None


def read(p: str, limit: int = 65536) -> str | None:
    try:
        with open(p) as f:
            return f.read(limit)
    except (OSError, ValueError):
        return None


#: Where systemd finds a unit's file (its search path, generators and transient units included), and the unit's
#: cgroup (it has one while it runs or is started or stopped).
UNIT_PLACES = ("/etc/systemd/system.control", "/run/systemd/system.control", "/run/systemd/transient",
               "/run/systemd/generator.early", "/etc/systemd/system", "/etc/systemd/system.attached", "/run/systemd/system",
               "/run/systemd/system.attached", "/run/systemd/generator", "/usr/local/lib/systemd/system",
               "/lib/systemd/system", "/usr/lib/systemd/system", "/run/systemd/generator.late", *UNIT_CGROUPS)


def unit_state(root: str, unit: str, wants: str, listeners: str) -> dict[str, str]:
    # Converged servers answer without systemctl (~10 ms of CPU each): a process in the unit's own cgroup
    # listening (ss names the pids) and the unit's wants link are "active" and "enabled". Anything
    # else asks systemd, which also names states such as failed or activating.
    pids = {part.split(",", 1)[0] for part in listeners.split("pid=")[1:]}
    running = False
    for pid in pids:
        cgroups = read(at(root, "/proc/%s/cgroup" % pid)) or ""
        running = running or any(line.endswith("/" + unit) for line in cgroups.splitlines())
    if running and os.path.islink(at(root, wants)):
        return {"active": "active", "enabled": "enabled"}
    # A bare server: no unit file systemd could load by that name and no cgroup of it is what systemd would say
    # "inactive" and "not-found" of, without asking it.
    if not any(os.path.lexists(at(root, (d % unit) if "%s" in d else d + "/" + unit)) for d in UNIT_PLACES):
        return {"active": "inactive", "enabled": "not-found"}
    # One systemctl call for both words.
    props = {}
    for line in run(["systemctl", "show", "--property=ActiveState,UnitFileState,LoadState", unit])["out"].splitlines():
        k, _, v = line.partition("=")
        props[k] = v.strip()
    enabled = props.get("UnitFileState") or ("not-found" if props.get("LoadState") == "not-found" else "")
    return {"active": props.get("ActiveState", ""), "enabled": enabled}


def binary_facts(root: str, b: str, version_args: list[str]) -> dict[str, Any]:
    binary: dict[str, Any] = {"exists": os.path.exists(at(root, b))}
    if binary["exists"]:
        st = os.stat(at(root, b))
        side = at(root, b + ".sha256")
        cached = None
        if os.path.exists(side) and os.stat(side).st_mtime >= st.st_mtime:
            cached = (read(side) or "").strip() or None
        ver = None  # written at install; executing a 44 MB Go binary on every observation costs ~30 ms
        version = at(root, b + ".version")
        if os.path.exists(version) and os.stat(version).st_mtime >= st.st_mtime:
            ver = {"code": 0, "out": read(version) or "", "err": ""}
        binary.update(size=st.st_size, sha256=cached, version=ver or run([at(root, b)] + version_args))
    return binary


ZSTD_DIRS = ("/usr/lib/%s-linux-gnu", "/lib/%s-linux-gnu", "/usr/lib64", "/usr/lib", "/lib64", "/lib")


def zstd_library() -> str:
    """Where libzstd is (the engine upload is then zstd: it inflates ~2.5x faster than gzip), "" when it is not
    here. Debian and Ubuntu have it on every install (apt and systemd need it); a stat per folder, no ldconfig."""
    machine = os.uname().machine
    for folder in ZSTD_DIRS:
        path = (folder % machine if "%s" in folder else folder) + "/libzstd.so.1"
        if os.path.exists(path):
            return path
    return ""


def main(req: dict[str, Any]) -> None:
    root = req.get("root", "/")
    listeners = str(run(["ss", "-Hlntup"])["out"])
    out = {
        "arch": os.uname().machine,
        "systemd": os.path.isdir(at(root, "/run/systemd/system")),
        "python": "%d.%d.%d" % sys.version_info[:3],
        "zstd": zstd_library(),
        "files": {p: sha(at(root, p)) for p in req["files"]},
        "binary": binary_facts(root, req["binary"], req.get("version_args", ["version"])),
        **unit_state(root, req["service"], req["wants"], listeners),
        "ss": listeners,
        "public": {p: read(at(root, p)) for p in req["public"]},
        "present": {p: os.path.exists(at(root, p)) for p in req["private"]},
        "lock": read(at(root, req["lock"])),
        "firewall": bool(req.get("firewall", True)) and run(["nft", "list", "table", "inet", "reconciler"])["code"] == 0,
        "extra": sorted(os.path.join(d, f) for d in req["dirs"] if os.path.isdir(at(root, d)) for f in os.listdir(at(root, d))),
    }
    sys.stdout.write(enc(out) + "\n")


if __name__ == "__main__":
    main(REQUEST)
