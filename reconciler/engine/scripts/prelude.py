"""What every server script shares, written once: spliced into each script's text where the script imports it.

The servers run each script alone, on their own ``python3 -I -S``: the reconciler is not installed there. So a
script imports its helpers from here like any module (linted, type-checked and unit-tested with it), and when it
is sent (``reconciler.engine.scripts.source``), the import line is replaced by this file's body, as Ansible
bundles its module helpers into each module it sends. Python 3.6 syntax (the agent's oldest), standard library
only, and nothing imported at start that a converged server's facts run does not need (annotations are strings).

- ``at(root, path)``: where a server path is (under ``root``, a fake host's directory in tests);
- ``write(path, data, mode)``: replace a file atomically and durably (temporary file, fsync, rename, folder fsync);
- ``listening_ports(root)``: the (port, transport) pairs the kernel has listening, read from ``/proc/net`` (no
  process per poll): TCP in LISTEN, UDP unconnected; ``listening_sockets(root)``: the same with their sockets' inodes;
- ``UNIT_CGROUPS``: where a systemd service's cgroup is, on each cgroup layout;
- ``loaded(source, name)``: another script run as a module in this process (a step carried by another's session);
- ``run(argv, limit, merge)``: a command's exit status and output, bounded by a deadline, through posix_spawn and
  a pipe (what subprocess would do, without its import: ~8 ms of a server's CPU at each script's start).
"""

import os
import select
import time

TYPE_CHECKING = False  # typing is not imported on the servers: mypy alone reads this import
if TYPE_CHECKING:
    from typing import Any


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


#: A systemd service's cgroup folder (``% unit``), which exists while the unit runs, starts or stops: the unified
#: hierarchy (cgroup v2), hybrid (v2 beside the v1 controllers), systemd's named hierarchy (cgroup v1).
UNIT_CGROUPS = ("/sys/fs/cgroup/system.slice/%s", "/sys/fs/cgroup/unified/system.slice/%s",
                "/sys/fs/cgroup/systemd/system.slice/%s")


def listening_sockets(root: "str") -> "dict[tuple[int, str], set[str]]":
    """The kernel's socket tables: (port, "tcp") for TCP in LISTEN (0A), (port, "udp") for UDP unconnected (07),
    each with the inodes of the sockets listening there."""
    have = {}  # type: dict[tuple[int, str], set[str]]
    for proto, state in (("tcp", "0A"), ("udp", "07")):
        for name in ("/proc/net/%s" % proto, "/proc/net/%s6" % proto):
            try:
                with open(at(root, name)) as f:
                    next(f)
                    for line in f:
                        parts = line.split()
                        if len(parts) > 9 and parts[3] == state:
                            have.setdefault((int(parts[1].rsplit(":", 1)[1], 16), proto), set()).add(parts[9])
            except (OSError, StopIteration, ValueError, IndexError):
                pass
    return have


def listening_ports(root: "str") -> "set[tuple[int, str]]":
    """The (port, transport) pairs listening (``listening_sockets`` without the inodes)."""
    return set(listening_sockets(root))


def loaded(source: "str", name: "str") -> "dict[str, Any]":
    """Another server script's text run as a module in this process: its functions (not its ``__main__``), without
    a Python start of its own."""
    scope = {"__name__": "reconciler_" + name}  # type: dict[str, Any]
    exec(compile(source, name, "exec"), scope)
    return scope


def run(argv: "list[str]", limit: "float" = 20.0, merge: "bool" = False) -> "dict[str, Any]":
    """``{"code", "out", "err"}`` of ``argv`` (searched in PATH), killed past ``limit`` seconds ("(timed out)" ends
    its output); ``merge``: its standard error in ``out`` too, else dropped. A command that cannot start: code -1."""
    r, w = os.pipe()
    try:
        pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=[
            (os.POSIX_SPAWN_DUP2, w, 1), (os.POSIX_SPAWN_CLOSE, r),
            (os.POSIX_SPAWN_DUP2, w, 2) if merge else (os.POSIX_SPAWN_OPEN, 2, "/dev/null", os.O_WRONLY, 0)])
    except OSError as e:
        os.close(r)
        os.close(w)
        return {"code": -1, "out": str(e) if merge else "", "err": str(e)}
    os.close(w)
    chunks, poll, deadline = [], select.poll(), time.monotonic() + limit
    poll.register(r, select.POLLIN | select.POLLHUP)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poll.poll(left * 1000):
            os.kill(pid, 9)
            chunks.append(b"(timed out)")
            break
        block = os.read(r, 65536)
        if not block:
            break
        chunks.append(block)
    os.close(r)
    return {"code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), "out": b"".join(chunks).decode(errors="replace"),
            "err": ""}
