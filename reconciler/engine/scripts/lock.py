"""The server's apply lock: a directory (``mkdir`` is atomic) holding a ``holder`` file.

``acquire`` first creates the folders the managed files live in (harmless under another's lock), then
takes the lock: ``{"ok": true}``, or ``{"ok": false, "holder": <the holder file's text>}`` when it is
held; with ``take_over`` it removes a stale lock first. ``renew`` rewrites the holder (a later ``since``)
only while the lock is there and still names the same holder (``by`` and ``pid``): it never makes a lock
that a commit released, nor touches another's. ``release`` removes it. The policy (who holds, the lease,
when a lock is stale, how often to renew) is the controller's: ``reconciler.plan.lock``.
"""

from __future__ import annotations

import json
import os
import shutil

TYPE_CHECKING = False  # typing is not imported on the servers: mypy alone reads these imports
if TYPE_CHECKING:
    from typing import Any

REQUEST: Any = None


def at(root: str, path: str) -> str:
    """Where a server path is: under ``root`` (a fake host's directory in tests), else itself."""
    return path if root == "/" else root.rstrip("/") + path


def acquire(req: dict[str, Any]) -> dict[str, Any]:
    root = req.get("root", "/")
    for d in req.get("dirs", ()):
        os.makedirs(at(root, d), exist_ok=True)
    for d in req.get("private", ()):
        os.chmod(at(root, d), 0o700)
    lock, holder = at(root, req["lock"]), at(root, req["holder_file"])
    if req.get("take_over"):
        shutil.rmtree(lock, ignore_errors=True)
    try:
        os.mkdir(lock)
    except FileExistsError:
        try:
            with open(holder) as f:
                return {"ok": False, "holder": f.read(4096)}
        except OSError:
            return {"ok": False, "holder": ""}
    with open(holder, "w") as f:
        f.write(req["holder"])
    return {"ok": True}


def renew(req: dict[str, Any]) -> dict[str, Any]:
    root = req.get("root", "/")
    holder = at(root, req["holder_file"])
    try:
        with open(holder) as f:
            text = f.read(4096)
        current = json.loads(text)
        new = json.loads(req["holder"])
        if not isinstance(current, dict) or [current.get("by"), current.get("pid")] != [new.get("by"), new.get("pid")]:
            return {"ok": False, "holder": text}
        tmp = holder + ".renew"
        with open(tmp, "w") as f:  # in the lock folder: gone with it, if a release removes it meanwhile
            f.write(req["holder"])
        os.replace(tmp, holder)
    except (OSError, ValueError):
        return {"ok": False, "holder": ""}
    return {"ok": True}


def release(req: dict[str, Any]) -> dict[str, Any]:
    shutil.rmtree(at(req.get("root", "/"), req["lock"]), ignore_errors=True)
    return {"ok": True}


def main(req: dict[str, Any]) -> None:
    ops = {"acquire": acquire, "renew": renew, "release": release}
    print(json.dumps(ops[req["op"]](req)))


if __name__ == "__main__":
    main(REQUEST)
