"""Scripts that run on the servers (Python 3 standard library only), sent over SSH on stdin.

- ``FACTS``: raw observations as JSON — hashes of managed files, the engine's ``version`` output,
  the unit's state, ``ss`` listening sockets, generated public material, the apply lock. The
  controller parses them (``reconciler.plan.facts``): the server-side stays dumb.
- ``COMMIT``: one transaction, one round trip. Writes the changed small files it carries, generates
  missing REALITY key pairs and self-signed certificates (existing ones are kept; the public halves
  are returned), renders ``config.json`` from the template (REALITY private keys are substituted
  here and never leave the server), runs ``sing-box check`` with the staged engine, keeps the old
  files (hard links), swaps the new ones in with atomic renames, reloads or restarts, and verifies
  the listeners within a timeout; on any failure it restores the old files, restarts and verifies
  again. It runs detached (``setsid``), so a dropped SSH session cannot leave a server
  half-switched, and it releases the apply lock when it ends.
"""

# The facts script runs on every server at every observation, so it starts lean: no json, subprocess,
# hashlib or platform imports (together ~35 ms of a small VPS's CPU, more than the work itself). The
# request is spliced in as a Python literal (``facts_script``) and the answer is written as JSON by hand.
FACTS = r'''
import os, select, sys, time
try:
    from _sha256 import sha256  # built in: no OpenSSL to load
except ImportError:
    try:
        from _sha2 import sha256
    except ImportError:
        from hashlib import sha256
req = @@REQUEST@@
ESC = {34: '\\"', 92: '\\\\', **{i: '\\u%04x' % i for i in range(32)}}
def enc(v):
    if v is None or v is True or v is False:
        return {None: "null", True: "true", False: "false"}[v]
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return '"' + v.translate(ESC) + '"'
    if isinstance(v, dict):
        return "{" + ",".join(enc(k) + ":" + enc(x) for k, x in v.items()) + "}"
    return "[" + ",".join(enc(x) for x in v) + "]"
def sha(p):
    try:
        with open(p, "rb") as f:
            return sha256(f.read()).hexdigest()
    except OSError:
        return None
def run(argv, limit=20.0):
    # posix_spawn and a pipe (what subprocess would do, without its import), bounded by a deadline.
    r, w = os.pipe()
    try:
        pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=[
            (os.POSIX_SPAWN_DUP2, w, 1), (os.POSIX_SPAWN_CLOSE, r),
            (os.POSIX_SPAWN_OPEN, 2, "/dev/null", os.O_WRONLY, 0)])
    except OSError as e:
        os.close(r)
        os.close(w)
        return {"code": -1, "out": "", "err": str(e)}
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
    return {"code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), "out": b"".join(chunks).decode(errors="replace"), "err": ""}
def read(p, limit=65536):
    try:
        with open(p) as f:
            return f.read(limit)
    except (OSError, ValueError):
        return None
def unit_state(unit, listeners):
    # Converged servers answer without systemctl (~10 ms of CPU each): a process in the unit's own cgroup
    # listening (ss names the pids) and the unit's wants link are "active" and "enabled". Anything
    # else asks systemd, which also names states such as failed or activating.
    pids = {part.split(",", 1)[0] for part in listeners.split("pid=")[1:]}
    running = False
    for pid in pids:
        cgroups = read("/proc/%s/cgroup" % pid) or ""
        running = running or any(line.endswith("/" + unit) for line in cgroups.splitlines())
    if running and os.path.islink(req["wants"]):
        return {"active": "active", "enabled": "enabled"}
    # One systemctl call for both words.
    props = {}
    for line in run(["systemctl", "show", "--property=ActiveState,UnitFileState,LoadState", unit])["out"].splitlines():
        k, _, v = line.partition("=")
        props[k] = v.strip()
    enabled = props.get("UnitFileState") or ("not-found" if props.get("LoadState") == "not-found" else "")
    return {"active": props.get("ActiveState", ""), "enabled": enabled}
b = req["binary"]
binary = {"exists": os.path.exists(b)}
if binary["exists"]:
    st = os.stat(b)
    side = b + ".sha256"
    cached = None
    if os.path.exists(side) and os.stat(side).st_mtime >= st.st_mtime:
        cached = (read(side) or "").strip() or None
    ver = None  # written at install; executing a 44 MB Go binary on every observation costs ~30 ms
    if os.path.exists(b + ".version") and os.stat(b + ".version").st_mtime >= st.st_mtime:
        ver = {"code": 0, "out": read(b + ".version") or "", "err": ""}
    binary.update(size=st.st_size, sha256=cached, version=ver or run([b, "version"]))
listeners = run(["ss", "-Hlntup"])["out"]
out = {
    "arch": os.uname().machine,
    "systemd": os.path.isdir("/run/systemd/system"),
    "python": "%d.%d.%d" % sys.version_info[:3],
    "files": {p: sha(p) for p in req["files"]},
    "binary": binary,
    **unit_state(req["service"], listeners),
    "ss": listeners,
    "public": {p: read(p) for p in req["public"]},
    "present": {p: os.path.exists(p) for p in req["private"]},
    "lock": read(req["lock"]),
    "firewall": bool(req.get("firewall", True)) and run(["nft", "list", "table", "inet", "reconciler"])["code"] == 0,
    "extra": sorted(os.path.join(d, f) for d in req["dirs"] if os.path.isdir(d) for f in os.listdir(d)),
}
sys.stdout.write(enc(out) + "\n")
'''


def facts_script(request: dict[str, object]) -> str:
    """The facts script with its request spliced in (a literal of strings, lists and booleans)."""
    return FACTS.replace("@@REQUEST@@", repr(request))


COMMIT = r'''
import base64, json, os, shutil, subprocess, sys, time
req = json.load(sys.stdin)
result = {"ok": False, "stage": "stage", "rolled_back": False, "error": "", "made": [], "public": {}, "seconds": {}}
clock = [time.monotonic()]
def step(name):
    # Seconds spent in each stage (apply --json shows them): where a slow server spends its commit.
    now = time.monotonic()
    result["seconds"][result["stage"]] = round(now - clock[0], 3)
    clock[0] = now
    result["stage"] = name
binary = req["binary_new"] if req.get("binary_new") and os.path.exists(req["binary_new"]) else req["binary"]
running = req.get("running", True)  # the engine was serving before this commit (from the facts)
def sh(cmd, timeout=60):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return r.returncode, (r.stdout + r.stderr)[-2000:]
def write(path, data, mode):
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
def stage():
    # The changed small files travel in this request (no file-transfer session per file).
    for f in req["files"]:
        write(f["path"], base64.b64decode(f["data"]), f["mode"])
def keys():
    # Missing REALITY key pairs and self-signed certificates are made here, once; existing ones are kept.
    for k in req["keys"]:
        a, b = k["paths"]
        if not (os.path.exists(a) and os.path.exists(b)):
            os.makedirs(os.path.dirname(a), mode=0o700, exist_ok=True)
            if k["kind"] == "reality":
                out = subprocess.run([binary, "generate", "reality-keypair"], capture_output=True, text=True, check=True).stdout
                vals = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
                files = ((a, vals["PrivateKey"].strip(), 0o600), (b, vals["PublicKey"].strip(), 0o644))
            else:
                out = subprocess.run([binary, "generate", "tls-keypair", k["server_name"], "-m", "120"],
                                     capture_output=True, text=True, check=True).stdout
                key = out[out.index("-----BEGIN PRIVATE KEY-----"):out.index("-----END PRIVATE KEY-----") + 25] + "\n"
                cert = out[out.index("-----BEGIN CERTIFICATE-----"):out.index("-----END CERTIFICATE-----") + 25] + "\n"
                files = ((a, cert, 0o644), (b, key, 0o600))
            for path, text, mode in files:
                write(path, text.encode(), mode)
            result["made"].append(k["inbound"])
        with open(b if k["kind"] == "reality" else a) as f:
            result["public"][b if k["kind"] == "reality" else a] = f.read()
def listening(want):
    # The kernel's socket tables (no ss process per poll): TCP in LISTEN (0A), UDP unconnected (07).
    have = set()
    for proto, state in (("tcp", "0A"), ("udp", "07")):
        for name in ("/proc/net/%s" % proto, "/proc/net/%s6" % proto):
            try:
                with open(name) as f:
                    next(f)
                    for line in f:
                        parts = line.split()
                        if len(parts) > 3 and parts[3] == state:
                            have.add((int(parts[1].rsplit(":", 1)[1], 16), proto))
            except OSError:
                pass
    return all((p, t) in have for p, t in want)
def verify():
    # Listeners from /proc every few ms; systemd asked only when they are up, or every half second
    # meanwhile so that a unit that failed or is crash-looping ends the wait at once.
    want = [tuple(x) for x in req["listeners"]]
    start = time.time()
    deadline, asked = start + req["verify_timeout"], start
    pause = 0.02
    while time.time() < deadline:
        if listening(want) and sh(["systemctl", "is-active", req["service"]])[0] == 0:
            return True
        if time.time() - asked >= 0.5:
            asked = time.time()
            state = unit("ActiveState,SubState")
            if state.get("ActiveState") == "failed" or state.get("SubState") == "auto-restart":
                return False
        time.sleep(pause)
        pause = min(pause * 1.5, 0.25)
    return False
def unit(props="LoadState,NeedDaemonReload,UnitFileState"):
    code, out = sh(["systemctl", "show", "--property=" + props, req["service"]])
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
def restart(action):
    # daemon-reload costs ~150 ms of the manager's time: only when systemd says the unit needs it
    # (a new unit file loads on first use; a changed one sets NeedDaemonReload).
    props = unit()
    if props.get("LoadState") != "loaded" or props.get("NeedDaemonReload") == "yes":
        sh(["systemctl", "daemon-reload"])
        props = unit()
    if props.get("UnitFileState") != "enabled":
        sh(["systemctl", "enable", "--no-reload", req["service"]])
    if action == "reload":
        code, out = sh(["systemctl", "reload", req["service"]])
        if code != 0:
            action = "restart"
    if action in ("restart", "start"):
        code, out = sh(["systemctl", "restart", req["service"]])
def render():
    with open(req["template_new"] if os.path.exists(req["template_new"]) else req["template"]) as f:
        text = f.read()
    for inbound, path in req["reality"].items():
        with open(path) as f:
            text = text.replace("@@REALITY_PRIVATE_KEY:%s@@" % inbound, f.read().strip())
    fd = os.open(req["config_new"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
moves = [(n, p) for n, p in req["moves"]] + [(req["config_new"], req["config"])]
backups = []
try:
    stage()
    step("keys")
    keys()
    step("render")
    render()
    step("check")
    # A running engine is protected by checking first. With none running there is nothing to protect:
    # the start itself is the check (~60 ms of CPU saved), and a failed start is explained below.
    if running:
        code, out = sh([binary, "check", "-c", req["config_new"]])
        if code != 0:
            raise RuntimeError("sing-box check rejected the new configuration: " + out.strip())
    step("swap")
    for new, path in moves:
        if os.path.exists(path):
            try:  # a hard link keeps the old file at no cost (the engine binary is tens of MB)
                if os.path.exists(path + ".reconciler-old"):
                    os.remove(path + ".reconciler-old")
                os.link(path, path + ".reconciler-old")
            except OSError:
                shutil.copy2(path, path + ".reconciler-old")
            backups.append(path)
    for new, path in moves:
        os.replace(new, path)
    step("restart")
    restart(req["action"])
    step("verify")
    if not verify():
        raise RuntimeError("the service did not come up with the new configuration (listeners %s)" % req["listeners"])
    step("done")
    result["ok"] = True
except Exception as e:
    result["error"] = str(e)[-1500:]
    if not running and result["stage"] in ("restart", "verify"):
        try:  # swapped in by now: the new engine and configuration are in place
            code, out = sh([req["binary"], "check", "-c", req["config"]])
            if code != 0:
                result["error"] = "sing-box check rejected the new configuration: " + out.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    if result["stage"] in ("restart", "verify", "swap"):
        for new, path in moves:
            if path in backups:
                os.replace(path + ".reconciler-old", path)
            elif os.path.exists(path) and (path != req["config"] or not running):
                os.remove(path)
        result["rolled_back"] = True
        if running:
            restart("restart")
            result["rollback_verified"] = verify()
        else:  # it was not running before: back to not running
            sh(["systemctl", "stop", req["service"]])
            result["rollback_verified"] = sh(["systemctl", "is-active", req["service"]])[0] != 0
finally:
    for new, _ in moves:
        if os.path.exists(new):
            os.remove(new)
    for path in backups:
        if os.path.exists(path + ".reconciler-old"):
            os.remove(path + ".reconciler-old")
    if req.get("lock"):
        shutil.rmtree(req["lock"], ignore_errors=True)
print(json.dumps(result))
'''

# Unpacks a gzip stream from stdin into argv[1]. Python's zlib inflates ~30% faster than gzip(1) on the
# servers we target, and unpacking as the bytes arrive overlaps it with the transfer.
INFLATE = r'''
import sys, zlib
d, out = zlib.decompressobj(31), open(sys.argv[1], "wb")
for block in iter(lambda: sys.stdin.buffer.read(1 << 20), b""):
    out.write(d.decompress(block))
out.write(d.flush())
if not d.eof:
    sys.exit("the engine upload ended early")
out.close()
'''

FIREWALL = r'''
import json, os, subprocess, sys, time
req = json.load(sys.stdin)
def sh(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, **kw)
old = sh(["nft", "list", "table", "inet", "reconciler"])
previous = old.stdout if old.returncode == 0 else None
ok_file = req["confirm"]
r = sh(["nft", "-f", req["new"]])
if r.returncode != 0:
    print(json.dumps({"ok": False, "error": "nft rejected the rules: " + r.stderr[-500:]}))
    sys.exit(0)
open(req["loaded"], "w").close()  # the controller now proves a fresh connection gets through
# Keep the rules only if the controller proves, over a fresh SSH connection, that it still gets in.
deadline = time.time() + req["timeout"]
while time.time() < deadline and not os.path.exists(ok_file):
    time.sleep(0.2)
if os.path.exists(ok_file):
    os.remove(ok_file)
    os.replace(req["new"], req["path"])
    sh(["systemctl", "daemon-reload"])
    sh(["systemctl", "enable", "reconciler-firewall.service"])
    print(json.dumps({"ok": True}))
else:
    sh(["nft", "delete", "table", "inet", "reconciler"])
    if previous:
        sh(["nft", "-f", "-"], input=previous)
    os.remove(req["new"])
    print(json.dumps({"ok": False, "error": "no fresh SSH connection got through with the new rules: rolled back"}))
'''
