"""Sandbox VPS hosts on this machine: network namespaces + systemd-nspawn with real systemd and sshd.

Each host is a network namespace on the bridge ``rlabbr0`` (198.18.0.1/24; host i
is 198.18.0.(100+i)) and a systemd-nspawn container booting real systemd from
an overlay on a debootstrap rootfs that is built once and cached in the lab
folder (git-ignored). Three details make it hold on a busy machine:
``--register=no --keep-unit``, a cgroup of its own per container, and a
raised ``fs.inotify.max_user_instances``.

Everything here needs root. Every wait is bounded; ``down`` removes whatever
``up`` created (also after a crash: it works from the state file), and only
processes the lab started, by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from reconciler.errors import LabError
from reconciler.state.files import write_atomic
from reconciler.text import plural

BRIDGE = "rlabbr0"
SUBNET = "198.18.0"
GATEWAY = f"{SUBNET}.1"  # this machine's side of the bridge: where the controller and test clients connect from
NS_PREFIX = "rlab"
ROOTFS_PACKAGES = "systemd,systemd-sysv,dbus,openssh-server,python3,iproute2,procps,nftables"
ROOTFS_VERSION = "3"  # bump when the rootfs recipe changes
BLOCK_TABLE = "rlab_block"
CENSOR_TABLE = "rlab_censor"  # in a host's own namespace: faults that need its conntrack (stall, server-name relay)




def lab_dir() -> Path:
    return Path(os.environ.get("RECONCILER_LAB_DIR", Path.cwd() / ".lab")).resolve()


def _run(cmd: list[str], check: bool = True, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and out.returncode != 0:
        raise LabError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return out


@dataclass
class Host:
    index: int
    name: str
    ip: str
    netns: str
    veth: str
    dir: str
    pid: int = 0

    @property
    def merged(self) -> Path:
        return Path(self.dir) / "merged"


@dataclass
class LabState:
    hosts: list[Host] = field(default_factory=list)
    inotify_before: int | None = None
    helpers: list[int] = field(default_factory=list)  # PIDs of processes the lab started (origins, ...)
    owner: list[Any] = field(default_factory=list)  # [pid, start time] of the process that brought it up

    @classmethod
    def load(cls, path: Path) -> LabState:
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        return cls(hosts=[Host(**h) for h in data.get("hosts", [])], inotify_before=data.get("inotify_before"),
                   helpers=data.get("helpers", []), owner=data.get("owner") or [])

    def save(self, path: Path) -> None:
        write_atomic(path, json.dumps({"hosts": [asdict(h) for h in self.hosts], "inotify_before": self.inotify_before,
                                       "helpers": self.helpers, "owner": self.owner}, indent=2).encode())


def _machine_hosts() -> list[Host]:
    """Every lab host on this machine, whichever lab made it: its names are the lab's own (namespaces ``rlabN``,
    overlay mounts ``…/hosts/vpsN/merged``, cgroups ``reconciler-lab/vpsN``), so no state file is needed to find it."""
    found: dict[int, Host] = {}

    def host(i: int) -> Host:
        return found.setdefault(i, Host(index=i, name=f"vps{i}", ip=f"{SUBNET}.{100 + i}", netns=f"{NS_PREFIX}{i}",
                                        veth=f"rlv{i}", dir=""))

    with contextlib.suppress(OSError):
        for name in os.listdir("/run/netns"):
            if name.startswith(NS_PREFIX) and name[len(NS_PREFIX):].isdigit():
                host(int(name[len(NS_PREFIX):]))
    for hierarchy in ("systemd", "unified"):
        with contextlib.suppress(OSError):
            for name in os.listdir(f"/sys/fs/cgroup/{hierarchy}/reconciler-lab"):
                if name.startswith("vps") and name[3:].isdigit():
                    host(int(name[3:]))
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and parts[2] == "overlay" and parts[1].endswith("/merged"):
                hdir = Path(parts[1]).parent
                if hdir.parent.name == "hosts" and hdir.name.startswith("vps") and hdir.name[3:].isdigit():
                    host(int(hdir.name[3:])).dir = str(hdir)
    return sorted(found.values(), key=lambda h: h.index)


def _running(host: Host) -> bool:
    """Whether anything runs in the host: a process in its namespace or its cgroup."""
    if _run(["ip", "netns", "pids", host.netns], check=False).stdout.split():
        return True
    for hierarchy in ("systemd", "unified"):
        root = Path(f"/sys/fs/cgroup/{hierarchy}/reconciler-lab/{host.name}")
        with contextlib.suppress(OSError):
            if any(procs.read_text().split() for procs in root.rglob("cgroup.procs")):
                return True
    return False


def _process(pid: int) -> tuple[int, str] | None:
    """(pid, start time) of a running process, which a reused PID does not share; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return pid, stat.rsplit(")", 1)[-1].split()[19]


class Lab:
    """N sandbox hosts. Use as a context manager, or ``up()`` / ``down()``."""

    def __init__(self, root: Path | None = None, log: Callable[[str], None] = lambda s: None):
        self.root = root or lab_dir()
        self.log = log
        self.state_path = self.root / "state.json"
        self.state = LabState.load(self.state_path)
        self._procs: dict[int, subprocess.Popen[bytes]] = {}  # children started by this process, reaped in down()

    # ------------------------------------------------------------------ paths

    @property
    def rootfs(self) -> Path:
        return self.root / "rootfs"

    @property
    def key(self) -> Path:
        return self.root / "keys" / "id_ed25519"

    # ------------------------------------------------------------------ build

    def check_requirements(self) -> None:
        if os.geteuid() != 0:
            raise LabError("the lab needs root (network namespaces, mounts, systemd-nspawn)")
        missing = [t for t in ("ip", "systemd-nspawn", "debootstrap", "nft", "ssh-keygen") if shutil.which(t) is None]
        if missing:
            raise LabError(f"missing tools: {', '.join(missing)}; run `make setup` (installs the Debian packages)")

    def build_rootfs(self) -> None:
        """debootstrap the host image once; later calls reuse it."""
        stamp = self.rootfs / ".reconciler-rootfs"
        if stamp.exists() and stamp.read_text().strip() == ROOTFS_VERSION:
            return
        self.check_requirements()
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / "rootfs.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        mirror = _debian_mirror()
        self.log(f"building the host image with debootstrap from {mirror} (once, about a minute)")
        _run(["debootstrap", "--variant=minbase", f"--include={ROOTFS_PACKAGES}", "bookworm", str(tmp), mirror],
             timeout=900)
        # sshd for the lab: keys only; host keys are made per host at start.
        conf = tmp / "etc/ssh/sshd_config.d/lab.conf"
        conf.write_text("PermitRootLogin prohibit-password\nPasswordAuthentication no\nMaxStartups 100:30:200\n"
                        "UseDNS no\n")
        for f in (tmp / "etc/ssh").glob("ssh_host_*"):
            f.unlink()
        (tmp / "etc/machine-id").write_text("")
        # A quieter, faster boot: nothing here needs these.
        for unit in ("systemd-networkd-wait-online.service", "apt-daily.timer", "apt-daily-upgrade.timer",
                     "e2scrub_all.timer", "fstrim.timer", "systemd-timesyncd.service"):
            link = tmp / "etc/systemd/system" / unit
            link.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                link.symlink_to("/dev/null")
        (tmp / ".reconciler-rootfs").write_text(ROOTFS_VERSION)
        if self.rootfs.exists():
            shutil.rmtree(self.rootfs)
        tmp.rename(self.rootfs)

    def ensure_key(self) -> Path:
        if not self.key.exists():
            self.key.parent.mkdir(parents=True, exist_ok=True)
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "reconciler-lab", "-f", str(self.key)])
        return self.key

    # ------------------------------------------------------------------ up / down

    def _refuse_when_in_use(self) -> None:
        """One lab at a time on a machine: every lab names its hosts, bridge and tables alike, so a second one would
        tear into the first. A lab is in use while the process that brought it up runs (not this one)."""
        owner = self.state.owner
        if owner and owner[0] != os.getpid() and _process(int(owner[0])) == (int(owner[0]), str(owner[1])):
            raise LabError(f"the lab in {self.root} is in use by process {owner[0]}: one lab at a time on a machine; "
                           "wait for it to finish, or stop that process")

    def _others(self) -> tuple[list[Host], list[Host]]:
        """The lab hosts on this machine this lab did not record: (running, left over). Running ones belong to a lab
        another checkout or process brought up; the others were left by a run that died before it cleaned up."""
        mine = {h.netns for h in self.state.hosts}
        others = [h for h in _machine_hosts() if h.netns not in mine]
        running = [h for h in others if _running(h)]
        return running, [h for h in others if h not in running]

    def up(self, count: int, timeout: float = 120.0) -> list[Host]:
        self._refuse_when_in_use()
        if self.state.hosts:
            raise LabError(f"a lab with {plural(len(self.state.hosts), 'host')} is already up; run `reconciler lab down` first")
        if not 1 <= count <= 99:
            raise LabError("between 1 and 99 hosts")
        self.check_requirements()
        running, left = self._others()
        if running:
            where = sorted({str(Path(h.dir).parent) for h in running if h.dir})
            raise LabError(f"another lab is running on this machine ({', '.join(h.name for h in running)}"
                           + (f", under {', '.join(where)}" if where else "") + "): one lab at a time on a machine; "
                           "wait for it to finish, or run `reconciler lab down` in its folder")
        self._remove(left)
        self.state.owner = list(_process(os.getpid()) or ())
        self.state.save(self.state_path)
        self.build_rootfs()
        self.ensure_key()
        pub = self.key.with_suffix(".pub").read_text()
        self._bridge_up()
        before = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
        self.state.inotify_before = before
        if before < 8192:
            Path("/proc/sys/fs/inotify/max_user_instances").write_text("8192")
        try:
            for i in range(1, count + 1):
                host = self._start_host(i, pub)
                self.state.hosts.append(host)
                self.state.save(self.state_path)
            self._wait_ssh(timeout)
            for host in self.state.hosts:  # conntrack counts bytes from a flow's start: a stall can hit any flow
                self.netns_exec(host, ["sysctl", "-qw", "net.netfilter.nf_conntrack_acct=1"], check=False)
        except BaseException:
            self.down()
            raise
        return list(self.state.hosts)

    def _bridge_up(self) -> None:
        if not Path(f"/sys/class/net/{BRIDGE}").exists():
            _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
            _run(["ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])

    def _start_host(self, i: int, pubkey: str) -> Host:
        name = f"vps{i}"
        host = Host(index=i, name=name, ip=f"{SUBNET}.{100 + i}", netns=f"{NS_PREFIX}{i}", veth=f"rlv{i}",
                    dir=str(self.root / "hosts" / name))
        hdir = Path(host.dir)
        if hdir.exists():
            with contextlib.suppress(subprocess.SubprocessError, LabError):
                _run(["umount", "-l", str(host.merged)], check=False)
            shutil.rmtree(hdir)
        for sub in ("upper", "work", "merged"):
            (hdir / sub).mkdir(parents=True)
        # Network: a namespace with a fixed-MAC veth on the bridge, no default route (RECIPE §1).
        _run(["ip", "netns", "add", host.netns])
        mac = f"02:00:c6:12:00:{i:02x}"
        _run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns,
              "address", mac])
        _run(["ip", "link", "set", host.veth, "master", BRIDGE, "up"])
        ns = ["ip", "netns", "exec", host.netns]
        _run([*ns, "ip", "addr", "add", f"{host.ip}/24", "dev", "eth0"])
        _run([*ns, "ip", "link", "set", "eth0", "up"])
        _run([*ns, "ip", "link", "set", "lo", "up"])
        # Filesystem: an overlay per host; its own hostname, host keys and authorized key.
        _run(["mount", "-t", "overlay", "overlay", "-o",
              f"lowerdir={self.rootfs},upperdir={hdir / 'upper'},workdir={hdir / 'work'}", str(host.merged)])
        (host.merged / "etc/hostname").write_text(name + "\n")
        _run(["ssh-keygen", "-A", "-f", str(host.merged)])
        ssh_dir = host.merged / "root/.ssh"
        ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        (ssh_dir / "authorized_keys").write_text(pubkey)
        os.chmod(ssh_dir / "authorized_keys", 0o600)
        # Boot: a cgroup of its own (else every container shares one), then nspawn in the namespace.
        script = (
            f"for h in systemd unified; do d=/sys/fs/cgroup/$h/reconciler-lab/{name}; mkdir -p $d; "
            f"echo $$ > $d/cgroup.procs 2>/dev/null || true; done; "
            f"exec setsid systemd-nspawn -q -D {host.merged} -M rlab-{name} -b --register=no --keep-unit "
            f"--capability=CAP_NET_ADMIN "  # root on a real VPS can manage its firewall
            f"--network-namespace-path=/run/netns/{host.netns}"
        )
        with open(hdir / "console.log", "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(["bash", "-c", script], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self._procs[proc.pid] = proc
        host.pid = proc.pid
        self.log(f"started {name} at {host.ip} (pid {proc.pid})")
        return host

    def _wait_ssh(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = {h.name: h for h in self.state.hosts}
        while pending and time.monotonic() < deadline:
            for name, host in list(pending.items()):
                with contextlib.suppress(OSError), socket.create_connection((host.ip, 22), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH"):
                        del pending[name]
            if pending:
                time.sleep(0.3)
        if pending:
            raise LabError(f"sshd did not come up within {timeout:.0f}s on: {', '.join(pending)} "
                           f"(console logs under {self.root / 'hosts'})")

    def _remove(self, left: list[Host]) -> None:
        for host in left:
            self.log(f"removing {host.name}, left over by a lab that did not clean up")
            self._stop_host(host)

    def down(self) -> None:
        """Tear down everything the lab created, and hosts a dead lab left; never a lab another process runs.
        Safe to call twice, and after a crash."""
        self._refuse_when_in_use()
        for pid in self.state.helpers:
            _kill_group(pid)
        self.state.helpers = []
        for host in self.state.hosts:  # ask every container to power off at once, then wait for each
            if host.pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(host.pid, signal.SIGTERM)
        for host in self.state.hosts:
            self._stop_host(host)
        self.state.hosts = []
        self.state.owner = []
        running, left = self._others()
        self._remove(left)
        if not running:  # the bridge, the blocking table and the cgroup are shared by every lab on the machine
            with contextlib.suppress(LabError, subprocess.SubprocessError):
                _run(["nft", "delete", "table", "bridge", BLOCK_TABLE], check=False)
            brif = Path(f"/sys/class/net/{BRIDGE}/brif")
            if brif.exists() and not any(brif.iterdir()):
                _run(["ip", "link", "del", BRIDGE], check=False)
            for h in ("systemd", "unified"):
                with contextlib.suppress(OSError):
                    os.rmdir(f"/sys/fs/cgroup/{h}/reconciler-lab")
        for proc in self._procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        self._procs.clear()
        if self.state.inotify_before is not None:
            with contextlib.suppress(OSError):
                Path("/proc/sys/fs/inotify/max_user_instances").write_text(str(self.state.inotify_before))
            self.state.inotify_before = None
        self.state.save(self.state_path)

    def _stop_host(self, host: Host) -> None:
        """After ``down`` asked every container to power off: wait, then remove what is left."""
        if host.pid:
            _wait_gone(host.pid, 15.0)
            _kill_group(host.pid)
        # Anything still inside the host's cgroup or namespace was started by this lab. The cgroup is the
        # reliable record: `setsid` may have forked, so the PID we started need not be nspawn's.
        pids = set(_run(["ip", "netns", "pids", host.netns], check=False).stdout.split())
        for h in ("systemd", "unified"):
            root = Path(f"/sys/fs/cgroup/{h}/reconciler-lab/{host.name}")
            if root.exists():
                for procs in root.rglob("cgroup.procs"):
                    with contextlib.suppress(OSError):
                        pids.update(procs.read_text().split())
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                os.kill(int(pid), signal.SIGKILL)
        if host.dir:  # a leftover found by its namespace alone has no mount
            _run(["umount", "-l", str(host.merged)], check=False)
        _run(["ip", "link", "del", host.veth], check=False)
        _run(["ip", "netns", "del", host.netns], check=False)
        for h in ("systemd", "unified"):
            root = Path(f"/sys/fs/cgroup/{h}/reconciler-lab/{host.name}")
            for _ in range(30):
                if not root.exists():
                    break
                for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [root]:
                    with contextlib.suppress(OSError):
                        os.rmdir(d)
                time.sleep(0.1)

    # ------------------------------------------------------------------ helpers for tests and the demo

    def host_key(self, host: Host) -> str:
        """The host's ed25519 public key, as `ssh-ed25519 AAAA...` (to pin it)."""
        parts = (host.merged / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()
        return f"{parts[0]} {parts[1]}"

    def netns_exec(self, host: Host, cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        return _run(["ip", "netns", "exec", host.netns, *cmd], **kw)

    def spawn_in(self, host: Host, cmd: list[str]) -> int:
        """Start a helper process in a host's network namespace (e.g. an HTTP origin); stopped by ``down``."""
        proc = subprocess.Popen(["ip", "netns", "exec", host.netns, *cmd], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self._procs[proc.pid] = proc
        self.state.helpers.append(proc.pid)
        self.state.save(self.state_path)
        return proc.pid

    def block(self, src: Host, dst: Host, port: int | None = None, proto: str | None = None) -> None:
        """Silently drop src → dst traffic on the bridge (invisible to the hosts), optionally one port."""
        _ensure_block_table()
        match = f"ip saddr {src.ip} ip daddr {dst.ip}"
        if port is not None:
            protos = [proto] if proto else ["tcp", "udp"]
            for p in protos:
                _nft_add(f"{match} {p} dport {port} counter drop")
        else:
            _nft_add(f"{match} counter drop")

    def block_outgoing(self, src: Host, dst: Host, udp_ports: tuple[int, ...] = ()) -> None:
        """A censor at src's border: src cannot open connections to dst (TCP SYNs dropped, and UDP to dst's
        ``udp_ports``), while dst's own connections to src and their answers pass, as with a censor that filters
        what its country's hosts initiate."""
        _ensure_block_table()
        _nft_add(f"ip saddr {src.ip} ip daddr {dst.ip} tcp flags & (syn | ack) == syn counter drop")
        for port in udp_ports:
            _nft_add(f"ip saddr {src.ip} ip daddr {dst.ip} udp dport {port} counter drop")

    def reset(self, src: Host, dst: Host, port: int) -> None:
        """Answer src's TCP connections to dst:port with a reset (rule inside dst's namespace)."""
        rule = (f"table inet rlab_reset {{\n chain input {{\n type filter hook input priority 0;\n"
                f" ip saddr {src.ip} tcp dport {port} reject with tcp reset\n }}\n}}\n")
        self.netns_exec(dst, ["nft", "-f", "-"], input=rule)

    # ------------------------------------------------------------------ censors' faults (HEALTH-16)

    def stall(self, dst: Host, src: Sequence[Host | str], port: int, after: int = 16384,
              protos: Sequence[str] = ("tcp",)) -> None:
        """A censor that lets the handshake through and then stalls the flow: what dst answers on ``port`` to any of
        ``src`` (hosts, or addresses such as ``GATEWAY``: this machine's side of the bridge) is dropped once the
        connection (a UDP flow: QUIC) carried ``after`` bytes that way (conntrack's count in dst's namespace)."""
        self.netns_exec(dst, ["sysctl", "-qw", "net.netfilter.nf_conntrack_acct=1"])
        addrs = ", ".join(h if isinstance(h, str) else h.ip for h in src)
        self._censor(dst, "out", "type filter hook output priority 0;",
                     *(f"ip daddr {{ {addrs} }} {p} sport {port} ct reply bytes > {after} drop" for p in protos))

    def sni_reset(self, dst: Host, src: Sequence[Host], port: int, names: Sequence[str]) -> None:
        """A censor that resets a ClientHello with one of ``names``: src's connections to dst:port go through a relay
        in dst's namespace (``reconciler.lab.middlebox``) that reads the server name, resets those, passes the rest."""
        relay = 40000 + port % 1000
        self.spawn_in(dst, [sys.executable, "-m", "reconciler.lab.middlebox", str(relay), str(port), ",".join(names)])
        addrs = ", ".join(h.ip for h in src)
        self._censor(dst, "pre", "type nat hook prerouting priority dstnat;",
                     f"ip saddr {{ {addrs} }} tcp dport {port} redirect to :{relay}")
        deadline = time.monotonic() + 10
        while self.netns_exec(dst, ["ss", "-Hltn", f"sport = :{relay}"], check=False).stdout.strip() == "":
            if time.monotonic() > deadline:
                raise LabError(f"the server-name filter did not listen on {dst.name}:{relay}")
            time.sleep(0.1)

    def drop_udp(self, src: Sequence[Host], dst: Host, port: int | None = None) -> None:
        """A censor that drops UDP: every datagram from ``src`` to dst (to ``port``) on the bridge."""
        _ensure_block_table()
        for h in src:
            _nft_add(f"ip saddr {h.ip} ip daddr {dst.ip} meta l4proto udp" + (f" udp dport {port}" if port else "")
                     + " counter drop")

    def allow_list(self, country: Sequence[Host], allowed: Sequence[Host]) -> None:
        """A whole-country allow-list: what the ``country``'s hosts open abroad is dropped unless its destination is
        ``allowed`` (TCP SYNs and every UDP datagram, on the bridge); the country's own hosts reach each other."""
        _ensure_block_table()
        inside = {h.ip for h in country}
        passes = ", ".join(sorted(inside | {h.ip for h in allowed}))
        for h in country:
            _nft_add(f"ip saddr {h.ip} ip daddr != {{ {passes} }} tcp flags & (syn | ack) == syn counter drop")
            _nft_add(f"ip saddr {h.ip} ip daddr != {{ {passes} }} meta l4proto udp counter drop")

    def _censor(self, host: Host, chain: str, hook: str, *rules: str) -> None:
        body = "\n ".join(rules)
        text = (f"table inet {CENSOR_TABLE} {{\n chain {chain} {{\n {hook}\n {body}\n }}\n}}\n")
        self.netns_exec(host, ["nft", "-f", "-"], input=text)

    def loss(self, src: Host, dst: Host, percent: int, port: int | None = None) -> None:
        _ensure_block_table()
        port_match = f" tcp dport {port}" if port else ""
        _nft_add(f"ip saddr {src.ip} ip daddr {dst.ip}{port_match} numgen random mod 100 < {percent} counter drop")

    def unblock_all(self) -> None:
        _run(["nft", "delete", "table", "bridge", BLOCK_TABLE], check=False)
        for host in self.state.hosts:
            self.netns_exec(host, ["nft", "delete", "table", "inet", "rlab_reset"], check=False)
            self.netns_exec(host, ["nft", "delete", "table", "inet", CENSOR_TABLE], check=False)
        for pid in [p for p in self.state.helpers if self._is_middlebox(p)]:  # the server-name filters
            _kill_group(pid)
            self.state.helpers.remove(pid)
            proc = self._procs.pop(pid, None)
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
        self.state.save(self.state_path)

    @staticmethod
    def _is_middlebox(pid: int) -> bool:
        try:
            return b"reconciler.lab.middlebox" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()


def _ensure_block_table() -> None:
    _run(["nft", "-f", "-"], input=(
        f"table bridge {BLOCK_TABLE} {{\n chain forward {{\n type filter hook forward priority 0; policy accept;\n }}\n}}\n"))


def _nft_add(rule: str) -> None:
    _run(["nft", "add", "rule", "bridge", BLOCK_TABLE, "forward", *rule.split()])


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return
        except ChildProcessError:
            if not Path(f"/proc/{pid}").exists():
                return
        time.sleep(0.1)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _debian_mirror() -> str:
    for source in Path("/etc/apt/sources.list.d").glob("*.sources"):
        for line in source.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    plain = Path("/etc/apt/sources.list")
    if plain.exists():
        for line in plain.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and "security" not in parts[1]:
                return parts[1]
    return "http://deb.debian.org/debian"
