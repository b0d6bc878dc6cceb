"""Stage the engine binary under a temporary name with its sidecars (``.sha256``, ``.version``).

Uploaded (``mode: upload``): a gzip stream on stdin, unpacked as the bytes arrive (Python's zlib
inflates ~30% faster than gzip(1) on the servers we target, and unpacking overlaps the transfer);
its sha256 was taken on the controller from the source. Downloaded (``mode: download``): fetched
from ``url`` on the server and hashed here. The version is the controller's when it could run the
same bytes (``version``), else this binary's own ``version`` output. Prints ``{"sha256", "version"}``;
on failure it removes what it staged and exits non-zero with the reason on stderr. The commit
moves the staged files into place.
"""

from __future__ import annotations

import json
import os
import sys

TYPE_CHECKING = False  # typing is not imported on the servers: mypy alone reads these imports
if TYPE_CHECKING:
    from typing import Any, BinaryIO

REQUEST: Any = None


def at(root: str, path: str) -> str:
    """Where a server path is: under ``root`` (a fake host's directory in tests), else itself."""
    return path if root == "/" else root.rstrip("/") + path


def inflate(src: BinaryIO, path: str) -> None:
    import zlib

    d = zlib.decompressobj(31)
    with open(path, "wb") as out:
        for block in iter(lambda: src.read(1 << 20), b""):
            out.write(d.decompress(block))
        out.write(d.flush())
    if not d.eof:
        raise RuntimeError("the engine upload ended early")


def download(url: str, path: str) -> str:
    import hashlib
    import urllib.request

    urllib.request.urlretrieve(url, path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def stage(req: dict[str, Any], src: BinaryIO) -> dict[str, str]:
    tmp = at(req.get("root", "/"), req["tmp"])
    if req["mode"] == "upload":
        inflate(src, tmp)
        digest = str(req["sha256"])
    else:
        digest = download(req["url"], tmp)
    with open(tmp + ".sha256", "w") as f:
        f.write(digest)
    os.chmod(tmp, 0o755)
    version = req.get("version")
    if not version:  # the controller could not run these bytes: the server does
        import subprocess

        run = subprocess.run([tmp, "version"], capture_output=True, text=True, timeout=60)
        if run.returncode != 0:
            raise RuntimeError("`sing-box version` exited %d: %s" % (run.returncode, run.stderr.strip()[-300:]))
        version = run.stdout
    with open(tmp + ".version", "w") as f:
        f.write(version)
    return {"sha256": digest, "version": version}


def main(req: dict[str, Any]) -> None:
    os.umask(0o022)
    tmp = at(req.get("root", "/"), req["tmp"])
    try:
        out = stage(req, sys.stdin.buffer)
    except Exception as e:
        for path in (tmp, tmp + ".sha256", tmp + ".version"):
            if os.path.exists(path):
                os.remove(path)
        sys.exit("cannot stage the engine: %s" % e)
    print(json.dumps(out))


if __name__ == "__main__":
    main(REQUEST)
