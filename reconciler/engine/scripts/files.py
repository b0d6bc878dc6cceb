"""Small file operations: ``read`` (old contents of changed files, for diffs; base64, at most ``limit``
bytes each, ``null`` when missing) and ``remove`` (stop and disable a service first when asked, remove
paths, reload systemd when asked). Prints one JSON object."""

from __future__ import annotations

import base64
import json
import os
import subprocess

from reconciler.engine.scripts.prelude import at  # spliced in when sent

TYPE_CHECKING = False  # typing is not imported on the servers: mypy alone reads these imports
if TYPE_CHECKING:
    from typing import Any

REQUEST: Any = None


def read(req: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, str | None] = {}
    for path in req["paths"]:
        try:
            with open(at(req.get("root", "/"), path), "rb") as f:
                out[path] = base64.b64encode(f.read(int(req.get("limit", 1 << 20)))).decode()
        except OSError:
            out[path] = None
    return {"files": out}


def remove(req: dict[str, Any]) -> dict[str, Any]:
    if req.get("stop"):  # a unit that is already gone is fine
        subprocess.run(["systemctl", "disable", "--now", req["stop"]], capture_output=True, timeout=120)
    removed = []
    for path in req["paths"]:
        try:
            os.remove(at(req.get("root", "/"), path))
            removed.append(path)
        except FileNotFoundError:
            pass
    for table in req.get("nft_tables") or []:  # per-user counters: gone with the server (absent is fine)
        subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True, timeout=60)
    if req.get("daemon_reload"):
        subprocess.run(["systemctl", "daemon-reload"], capture_output=True, timeout=120, check=True)
    return {"removed": removed}


def main(req: dict[str, Any]) -> None:
    print(json.dumps(read(req) if req["op"] == "read" else remove(req)))


if __name__ == "__main__":
    main(REQUEST)
