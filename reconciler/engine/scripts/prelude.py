"""What every server script shares, written once: spliced into each script's text where the script imports it.

The servers run each script alone, on their own ``python3 -I -S``: the reconciler is not installed there. So a
script imports its helpers from here like any module (linted, type-checked and unit-tested with it), and when it
is sent (``reconciler.engine.scripts.source``), the import line is replaced by this file's body, as Ansible
bundles its module helpers into each module it sends. Python 3.6 syntax (the agent's oldest), standard library
only, and nothing imported at start that a converged server's facts run does not need (annotations are strings).

- ``at(root, path)``: where a server path is (under ``root``, a fake host's directory in tests);
- ``write(path, data, mode)``: replace a file atomically and durably (temporary file, fsync, rename, folder fsync);
- ``listening_ports(root)``: the (port, transport) pairs the kernel has listening, read from ``/proc/net`` (no
  process per poll): TCP in LISTEN, UDP unconnected.
"""

import os


def at(root: "str", path: "str") -> "str":
    """Where a server path is: under ``root`` (a fake host's directory in tests), else itself."""
    return path if root == "/" else root.rstrip("/") + path


def write(path: "str", data: "bytes", mode: "int") -> "None":
    """Replace ``path`` with ``data``: a reader or a crash sees the old content or the new, and once this returns
    the new content survives a power loss."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    try:
        folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


def listening_ports(root: "str") -> "set[tuple[int, str]]":
    """The kernel's socket tables: (port, "tcp") for TCP in LISTEN (0A), (port, "udp") for UDP unconnected (07)."""
    have = set()
    for proto, state in (("tcp", "0A"), ("udp", "07")):
        for name in ("/proc/net/%s" % proto, "/proc/net/%s6" % proto):
            try:
                with open(at(root, name)) as f:
                    next(f)
                    for line in f:
                        parts = line.split()
                        if len(parts) > 3 and parts[3] == state:
                            have.add((int(parts[1].rsplit(":", 1)[1], 16), proto))
            except (OSError, StopIteration, ValueError, IndexError):
                pass
    return have
