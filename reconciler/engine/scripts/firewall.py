"""Load the firewall, and keep it only if the controller proves a new SSH connection still gets in.

Four operations, each one round trip (the request names every path):
- ``prepare``: write the boot unit and the new rules (beside the old ones), clear a previous run's marks;
- ``apply`` (run detached, so the rules may cut nothing but new connections): load the new rules, mark
  them loaded, wait up to ``timeout`` for the confirmation; then keep them (rename into place, enable the
  boot unit) or restore the previous table. Its answer is written to ``out``;
- ``status``: whether the rules are loaded, and ``out`` once the apply has finished;
- ``confirm``: sent over a brand-new SSH connection: it got through, keep the rules.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time

from reconciler.engine.scripts.prelude import at, write  # spliced in when sent

TYPE_CHECKING = False  # typing is not imported on the servers: mypy alone reads these imports
if TYPE_CHECKING:
    from typing import Any

REQUEST: Any = None
UNIT = "reconciler-firewall.service"


def sh(cmd: list[str], input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, input=input)


def prepare(req: dict[str, Any], root: str) -> dict[str, Any]:
    for path in (req["out"], req["confirm"], req["loaded"]):
        if os.path.exists(at(root, path)):
            os.remove(at(root, path))
    for f in req["files"]:
        os.makedirs(os.path.dirname(at(root, f["path"])), exist_ok=True)
        write(at(root, f["path"]), base64.b64decode(f["data"]), f["mode"])
    return {"ok": True}


def apply(req: dict[str, Any], root: str) -> dict[str, Any]:
    old = sh(["nft", "list", "table", "inet", "reconciler"])
    previous = old.stdout if old.returncode == 0 else None
    new, ok_file = at(root, req["new"]), at(root, req["confirm"])
    r = sh(["nft", "-f", new])
    if r.returncode != 0:
        return {"ok": False, "error": "nft rejected the rules: " + r.stderr[-500:]}
    open(at(root, req["loaded"]), "w").close()  # the controller now proves a fresh connection gets through
    # Keep the rules only if the controller proves, over a fresh SSH connection, that it still gets in.
    deadline = time.time() + req["timeout"]
    while time.time() < deadline and not os.path.exists(ok_file):
        time.sleep(0.2)
    if os.path.exists(ok_file):
        os.remove(ok_file)
        os.replace(new, at(root, req["path"]))
        sh(["systemctl", "daemon-reload"])
        sh(["systemctl", "enable", UNIT])
        return {"ok": True}
    sh(["nft", "delete", "table", "inet", "reconciler"])
    if previous:
        sh(["nft", "-f", "-"], input=previous)
    os.remove(new)
    return {"ok": False, "error": "no fresh SSH connection got through with the new rules: rolled back"}


def status(req: dict[str, Any], root: str) -> dict[str, Any]:
    try:
        with open(at(root, req["out"])) as f:
            out = f.read()
    except OSError:
        out = ""
    return {"loaded": os.path.exists(at(root, req["loaded"])), "out": out}


def main(req: dict[str, Any]) -> None:
    root = req.get("root", "/")
    if req["op"] == "apply":
        try:
            answer = apply(req, root)
        except Exception as e:  # noqa: BLE001 — the controller waits for an answer: give one
            answer = {"ok": False, "error": "the firewall script failed: %s" % e}
        write(at(root, req["out"]), json.dumps(answer).encode(), 0o600)
        return
    if req["op"] == "confirm":
        open(at(root, req["confirm"]), "w").close()
        answer = {"ok": True}
    else:
        answer = prepare(req, root) if req["op"] == "prepare" else status(req, root)
    print(json.dumps(answer))


if __name__ == "__main__":
    main(REQUEST)
