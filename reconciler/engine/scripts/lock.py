"""The server's apply lock: a directory (``mkdir`` is atomic) holding a ``holder`` file.

``acquire`` first creates the folders the managed files live in (harmless under another's lock), then
takes the lock: ``{"ok": true}``, or ``{"ok": false, "holder": <the holder file's text>}`` when it is
held; with ``take_over`` it removes a stale lock first. ``renew`` rewrites the holder (a later ``since``)
only while the lock is there and still names the same holder (``by`` and ``pid``): it never makes a lock
that a commit released, nor touches another's. ``release`` removes it. The policy (who holds, the lease,
when a lock is stale, how often to renew) is the controller's: ``reconciler.plan.lock``.

Fencing: an ``acquire`` that carries a ``fence`` (the leading controller's etcd revision; none
from a controller without an election, nor from an operator's ``reconciler apply``) is checked under the
lock, before anything changes: the server keeps the highest fence it has accepted in ``fence_file``
(written atomically) and refuses a lower one — ``{"ok": false, "refused": <why>}``, the lock given back
untouched — so a deposed leader never applies where a newer one has.

``then`` (an acquire's): the next script of the apply, run in this same process once the lock is taken; its request
spliced in (``then_request``) or, for a script that reads it on stdin (``then_reads_request``), read from there.
"""

from __future__ import annotations

import json
import os
import shutil

from reconciler.engine.scripts.prelude import at, loaded  # spliced in when sent

TYPE_CHECKING = False  # typing is not imported on the servers: mypy alone reads these imports
if TYPE_CHECKING:
    from typing import Any

REQUEST: Any = None


def fenced(root: str, req: dict[str, Any]) -> str | None:
    """Under the lock: why this request's fence is refused, or None (a newer fence is recorded first)."""
    fence = req.get("fence")
    if not fence:
        return None
    path = at(root, req["fence_file"])
    try:
        with open(path) as f:
            seen = int(f.read(64).strip() or 0)
    except (OSError, ValueError):
        seen = 0
    if int(fence) < seen:
        return ("refused: a newer controller (fence %d) has applied here; this one (fence %d) is not the leader"
                % (seen, int(fence)))
    if int(fence) > seen:
        folder = os.path.dirname(path)
        if not os.path.isdir(folder):
            os.makedirs(folder, 0o700)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write("%d\n" % int(fence))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return None


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
    try:
        refused = fenced(root, req)
    except BaseException:
        shutil.rmtree(lock, ignore_errors=True)
        raise
    if refused:
        shutil.rmtree(lock, ignore_errors=True)  # ours, just made: given back untouched
        return {"ok": False, "refused": refused}
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
    """Remove the lock; with ``holder`` (``release_if``), only while its holder file says exactly that: a lock
    this controller may or may not have taken (its session failed midway) is never another's to remove."""
    root = req.get("root", "/")
    if "holder" in req:
        try:
            with open(at(root, req["holder_file"])) as f:
                if f.read(4096) != req["holder"]:
                    return {"ok": False}
        except OSError:
            return {"ok": False}
    shutil.rmtree(at(root, req["lock"]), ignore_errors=True)
    return {"ok": True}


def then(req: dict[str, Any], taken: bool) -> None:
    """An acquire's ``then``: another script's source and request (``then_request``), run in this process once
    the lock is taken (``reconciler.plan.lock.Deferred``: a Python start and a round trip less). It answers
    on the next line. Not taken: it never runs, and what it would have read on stdin is read and dropped, so
    that the controller's upload ends."""
    if taken:
        if req.get("then_reads_request"):  # a script whose request is on stdin (the commit): read here for it
            import sys

            inner = json.load(sys.stdin)
        else:
            inner = dict(req["then_request"])
        if "root" in req:  # a fake host's directory (tests): the same for both
            inner["root"] = req["root"]
        loaded(req["then"], str(req.get("then_name", "then")))["main"](inner)
    elif req.get("then_stdin"):
        import sys

        for _ in iter(lambda: sys.stdin.buffer.read(1 << 16), b""):
            pass


def main(req: dict[str, Any]) -> None:
    ops = {"acquire": acquire, "renew": renew, "release": release}
    out = ops[req["op"]](req)
    print(json.dumps(out), flush=True)
    if req["op"] == "acquire" and req.get("then"):
        then(req, bool(out.get("ok")))


if __name__ == "__main__":
    main(REQUEST)
