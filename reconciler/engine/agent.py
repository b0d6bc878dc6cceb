#!/usr/bin/env python3
"""The collection agent: one run per report interval on every server (HEALTH-1, HEALTH-4).

Python 3 standard library only: it is installed on the servers as a managed
file (``/usr/local/lib/reconciler/agent.py``) and never imports the reconciler: its one import of it, the
scripts' shared prelude, is spliced in when the file is installed (``engine.scripts.spliced``).
The controller runs it over SSH with a JSON request on stdin and reads one JSON
object from stdout:

- ``service``: the engine unit's ``systemctl is-active`` word;
- ``listeners``: which of the requested ``port/transport`` pairs are listening;
- ``traffic``: the engine's cumulative byte counters from its loopback
  clash_api (``null`` when the API does not answer). The controller turns
  them into rates and handles resets; the agent keeps no state;
- ``users``: the users with open connections (the ``u-<name>`` outbound every
  user's traffic is routed through), and ``connections``;
- ``devices``: per user, fingerprints of the client addresses of those connections
  (salted hashes: the controller counts distinct devices, never sees an address);
- ``usage``: the kernel's per-user counters (the nftables table the engine's unit
  loads; loaded here when missing), per direction, cumulative, packed (``packed``):
  the (ip version, transport) pairs seen, and four columns of little-endian numbers
  in base64: mark (u32), index of the pair (u8), packets and bytes (u64). A thousand
  users' rows as JSON lists cost the controller ~3 µs each to parse; these cost it
  next to nothing (agent 1 sent the rows as lists, which it still reads). The
  controller turns marks into users and counters into traffic;
- ``probes``: every other server's inbounds probed the way a client would: a
  TCP connect (its time is the RTT) plus a TLS handshake with the inbound's
  server name for TLS protocols; for QUIC protocols (Hysteria2, TUIC) a QUIC
  Initial with a reserved version, which every QUIC server answers with a
  Version Negotiation packet (RFC 9000 §6) — a UDP round trip without keys;
  and, when the request has an ``app`` part (HEALTH-16), a real proxy session through each inbound: the
  server's own engine binary runs in client mode with the configuration the controller wrote (one loopback
  SOCKS port per inbound, the probe credential), and through it the agent fetches the target's responder's
  padded answer (``bytes`` of it), so a flow that a censor stalls after the handshake, resets on its server
  name or drops (UDP) fails here as it fails in a user's app. Each probe's ``app`` says ``ok``, the
  ``bytes`` that came, ``ms``, and the ``error`` (``stalled after 14480 bytes``); ``local`` instead when the
  witness's own client could not run (that says nothing about the target).

Every probe and the whole run are bounded by the request's timeout.
"""

import asyncio
import hmac
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Dict, List, Optional, Set, Tuple  # typing's generics: the servers' Python may predate list[...]

from reconciler.engine.scripts.prelude import listening_ports  # spliced in when installed

AGENT_VERSION = 4  # 2: usage packed; 3: app probes; 4: device fingerprints as HMACs


def service_state(unit: str) -> str:
    try:
        r = subprocess.run(["systemctl", "is-active", unit], capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def listening(wanted: List[Tuple[int, str]], root: str = "/") -> Dict[str, bool]:
    have = listening_ports(root)
    return {f"{p}/{t}": (p, t) in have for p, t in wanted}


def usage_counters(table: str, load: str, timeout: float) -> Dict[str, Any]:
    """The per-user counters of ``table`` (sets ``tx`` and ``rx``); ``load``: the file that creates it when missing."""
    handles = []  # the sets' handles: a table created again (a reboot, a manual delete) has new ones

    def listed(name: str) -> Optional[List[List[Any]]]:
        try:
            r = subprocess.run(["nft", "-j", "list", "set", "inet", table, name], capture_output=True, text=True,
                               timeout=timeout)
        except (OSError, subprocess.SubprocessError):
            return None
        if r.returncode != 0:
            return None
        try:
            doc = json.loads(r.stdout)
        except ValueError:  # not nft's JSON (a broken or foreign nft): no counters this interval, the rest reported
            return None
        rows = []
        for item in (doc.get("nftables", []) if isinstance(doc, dict) else []):
            if item.get("set"):
                handles.append(str(item["set"].get("handle", "")))
            for elem in (item.get("set") or {}).get("elem") or []:
                e = elem.get("elem") if isinstance(elem, dict) else None
                if not isinstance(e, dict):
                    continue
                key, counter = (e.get("val") or {}).get("concat"), e.get("counter") or {}
                if isinstance(key, list) and len(key) == 3:
                    rows.append([key[0], str(key[1]), str(key[2]), counter.get("packets", 0), counter.get("bytes", 0)])
        return rows

    tx = listed("tx")
    if tx is None and load and os.path.exists(load):
        try:  # a reboot flushed it, or the engine has not restarted since the file arrived
            subprocess.run(["nft", "-f", load], capture_output=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError):
            pass
        tx = listed("tx")
    rx = listed("rx") if tx is not None else None
    if tx is None or rx is None:
        return {"error": "no per-user counters: is nftables installed (the `nft` command)?"}
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return {"packed": 1, "tx": packed(tx), "rx": packed(rx), "epoch": boot + "/" + "/".join(handles)}


def packed(rows: List[List[Any]]) -> Dict[str, Any]:
    """``[mark, family, transport, packets, bytes]`` rows as the report's packed columns (see the docstring)."""
    import array
    import base64

    pairs = {}  # type: Dict[Tuple[str, str], int]
    marks, kinds, packets, nbytes = array.array("I"), array.array("B"), array.array("Q"), array.array("Q")
    dropped = 0  # rows the kernel could not have made (the controller then says the counters are unreadable)
    for mark, family, transport, p, b in rows:
        if not all(type(v) is int and 0 <= v < 2**64 for v in (mark, p, b)) or mark >= 2**32:
            dropped += 1  # the set's key is a 32-bit mark and its counters 64-bit
            continue
        pair = (str(family), str(transport))
        if pair not in pairs:
            if len(pairs) == 255:
                dropped += 1  # the kernel knows a handful; more would be a broken table
                continue
            pairs[pair] = len(pairs)
        marks.append(mark)
        kinds.append(pairs[pair])
        packets.append(p)
        nbytes.append(b)
    out = {"rows": len(marks), "kinds": [list(k) for k in pairs], "dropped": dropped}  # type: Dict[str, Any]
    for name, column in (("mark", marks), ("kind", kinds), ("packets", packets), ("bytes", nbytes)):
        if sys.byteorder == "big":
            column.byteswap()
        out[name] = base64.b64encode(column.tobytes()).decode()
    return out


def clash_connections(address: str, secret: str, timeout: float,
                      salt: str = "") -> Tuple[Optional[Dict[str, int]], List[str], int, Dict[str, List[str]]]:
    req = urllib.request.Request(f"http://{address}/connections", headers={"Authorization": f"Bearer {secret}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = json.loads(resp.read(16 * 1024 * 1024))
    except (OSError, ValueError):
        return None, [], 0, {}
    conns = data.get("connections") or []
    devices: Dict[str, Set[str]] = {}
    for c in conns:
        for tag in c.get("chains") or []:
            if isinstance(tag, str) and tag.startswith("u-"):
                seen = devices.setdefault(tag[2:], set())
                source = str((c.get("metadata") or {}).get("sourceIP") or "")
                if source:  # keyed (the day's key from the controller): no address can be found again from it
                    seen.add(hmac.new(salt.encode(), (tag[2:] + "\n" + source).encode(), "sha256").hexdigest()[:16])
    traffic = {"up": int(data.get("uploadTotal") or 0), "down": int(data.get("downloadTotal") or 0)}
    return traffic, sorted(devices), len(conns), {u: sorted(d) for u, d in devices.items()}


def quic_probe_packet() -> Tuple[bytes, bytes, bytes]:
    """A 1200-byte QUIC long-header Initial with a reserved version (0x?a?a?a?a): servers reply with Version Negotiation."""
    dcid, scid = os.urandom(8), os.urandom(8)
    head = bytes([0xC0]) + bytes.fromhex("1a2a3a4a") + bytes([len(dcid)]) + dcid + bytes([len(scid)]) + scid
    return head + os.urandom(1200 - len(head)), dcid, scid


class _Quic(asyncio.DatagramProtocol):
    def __init__(self, scid: bytes) -> None:
        self.scid = scid
        self.done = asyncio.get_running_loop().create_future()  # type: asyncio.Future[bool]

    def datagram_received(self, data: bytes, addr: Tuple[str, int]) -> None:
        # Version Negotiation: long header, version 0, echoing our source connection id as its destination.
        if len(data) >= 7 and data[0] & 0x80 and data[1:5] == b"\0\0\0\0":
            dlen = data[5]
            if data[6:6 + dlen] == self.scid and not self.done.done():
                self.done.set_result(True)

    def error_received(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


_contexts = {}  # type: Dict[Tuple[str, ...], ssl.SSLContext]


def tls_context(alpn: Tuple[str, ...]) -> ssl.SSLContext:
    """One client context per ALPN list for the whole run: reachability, not trust (self-signed and camouflage
    certificates), so no CA store is loaded (loading it cost ~10 ms of CPU a probe)."""
    ctx = _contexts.get(alpn)
    if ctx is None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        if alpn:
            ctx.set_alpn_protocols(list(alpn))
        _contexts[alpn] = ctx
    return ctx


async def probe(p: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    host, port, kind = p["host"], int(p["port"]), p.get("kind", "tcp")
    start = time.perf_counter()
    try:
        if kind == "quic":
            loop = asyncio.get_running_loop()
            packet, _, scid = quic_probe_packet()
            transport, proto = await loop.create_datagram_endpoint(lambda: _Quic(scid), remote_addr=(host, port))
            try:
                for attempt in range(3):  # UDP: resend within the budget
                    transport.sendto(packet)
                    try:
                        await asyncio.wait_for(asyncio.shield(proto.done), timeout / 3)
                        break
                    except asyncio.TimeoutError:
                        if attempt == 2:
                            raise
                        start = time.perf_counter()
            finally:
                transport.close()
            return {"ok": True, "rtt_ms": round((time.perf_counter() - start) * 1000, 3)}
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        rtt = (time.perf_counter() - start) * 1000
        try:
            if kind == "tls":
                ctx = tls_context(tuple(p.get("alpn") or ()))
                await asyncio.wait_for(writer.start_tls(ctx, server_hostname=p.get("sni") or None), timeout)
        finally:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1)
            except (OSError, asyncio.TimeoutError, ssl.SSLError):
                pass
        return {"ok": True, "rtt_ms": round(rtt, 3)}
    except asyncio.TimeoutError:
        return {"ok": False, "error": "timeout"}
    except (OSError, ssl.SSLError, EOFError, ValueError) as e:
        return {"ok": False, "error": (type(e).__name__ + ": " + str(e))[:200]}


def _socks_connect(host: str, port: int) -> bytes:
    try:
        return b"\x05\x01\x00\x01" + socket.inet_pton(socket.AF_INET, host) + port.to_bytes(2, "big")
    except OSError:
        return b"\x05\x01\x00\x04" + socket.inet_pton(socket.AF_INET6, host) + port.to_bytes(2, "big")


async def _socks_open(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, port: int,
                      deadline: float) -> Optional[Dict[str, Any]]:
    """The SOCKS 5 greeting and CONNECT through the local client: None once the session is open, else the probe's
    answer. A stall or a reset raises (the caller words it as the proxy session's)."""
    writer.write(b"\x05\x01\x00")
    try:
        greeting = await asyncio.wait_for(reader.readexactly(2), 2)
    except (asyncio.TimeoutError, EOFError, OSError):
        greeting = b""
    if greeting != b"\x05\x00":
        return {"local": "the probe client did not answer the SOCKS greeting"}
    writer.write(_socks_connect(host, port))
    head = await asyncio.wait_for(reader.readexactly(4), max(0.1, deadline - time.perf_counter()))
    if head[0] != 5:
        return {"local": "the probe client answered something that is not SOCKS 5"}
    if head[3] == 3:  # a name: its length, then the name and the port
        rest = (await asyncio.wait_for(reader.readexactly(1), max(0.1, deadline - time.perf_counter())))[0] + 2
    else:
        rest = {1: 6, 4: 18}.get(head[3], 0)
    if rest:
        await asyncio.wait_for(reader.readexactly(rest), max(0.1, deadline - time.perf_counter()))
    if head[1] != 0:
        return {"ok": False, "bytes": 0, "error": "the proxy session was refused (SOCKS reply %d)" % head[1]}
    return None


class _Answer:
    """What has come back of the responder's answer so far: the byte count (an error reports it), the first 16
    bytes (the status line) and the last 4 (the blank line that ends the padding)."""

    def __init__(self) -> None:
        self.got = 0
        self.first = b""
        self.tail = b""

    def add(self, data: bytes) -> None:
        self.got += len(data)
        if len(self.first) < 16:
            self.first = (self.first + data)[:16]
        self.tail = (self.tail + data)[-4:]

    def complete(self, want: int) -> bool:
        return self.got >= want and self.tail == b"\r\n\r\n"


async def _read_answer(reader: asyncio.StreamReader, answer: _Answer, want: int, deadline: float) -> None:
    """Reads into ``answer`` until the server closes or the padded answer is complete; past the deadline it raises
    asyncio.TimeoutError (``answer`` keeps what came)."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            raise asyncio.TimeoutError
        data = await asyncio.wait_for(reader.read(65536), left)
        if not data:
            break
        answer.add(data)
        if answer.complete(want):
            break


def _answer_verdict(answer: _Answer, want: int, ms: float) -> Dict[str, Any]:
    got = answer.got
    if answer.first.startswith(b"HTTP/1.1 503"):  # the target's responder is full: nothing is known of the path
        return {"local": "the target's responder was busy"}
    if answer.complete(want):
        if not answer.first.startswith(b"HTTP/1.1 204"):
            return {"ok": False, "bytes": got, "ms": ms, "error": "an answer that is not the responder's"}
        return {"ok": True, "bytes": got, "ms": ms}
    return {"ok": False, "bytes": got, "ms": ms,
            "error": "closed after %d bytes" % got if got else "closed before any byte came back"}


def _stall_error(got: int, stage: str, timeout: float) -> str:
    if got:
        return "stalled after %d bytes" % got
    if stage == "the answer":
        return "no answer within %gs" % timeout
    return "%s did not open within %gs" % (stage, timeout)


async def app_probe(local_port: int, app: Dict[str, Any]) -> Dict[str, Any]:
    """One session through the local client to the target's responder: its padded answer, to the end."""
    want, timeout = int(app["bytes"]), float(app["timeout"])
    host, port = app["responder"][0], int(app["responder"][1])
    start = time.perf_counter()
    deadline = start + timeout
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", local_port), 2)
    except (OSError, asyncio.TimeoutError) as e:
        return {"local": ("the probe client is not listening: %s" % e)[:200]}
    answer = _Answer()
    stage = "the proxy session"
    try:
        failed = await _socks_open(reader, writer, host, port, deadline)
        if failed is not None:
            return failed
        stage = "the answer"
        writer.write(("GET %s HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n" % app["path"]).encode())
        await _read_answer(reader, answer, want, deadline)
        return _answer_verdict(answer, want, round((time.perf_counter() - start) * 1000, 1))
    except asyncio.TimeoutError:
        return {"ok": False, "bytes": answer.got, "error": _stall_error(answer.got, stage, timeout)}
    except (OSError, EOFError, asyncio.IncompleteReadError) as e:
        return {"ok": False, "bytes": answer.got, "error": ("%s after %d bytes: %s" % (type(e).__name__, answer.got, e))[:200]}
    finally:
        writer.close()


def _die_with_parent() -> None:
    """In the client, before it runs: the kernel kills it when the agent dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def _sweep(older_than: float = 600.0) -> None:
    """Folders an agent killed by SIGKILL could not remove (never one of a run in progress: those are young)."""
    base = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(base) if n.startswith("reconciler-probe-")]
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        try:
            if time.time() - os.stat(path).st_mtime > older_than:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


class AppClient:
    """The witness's engine in client mode, for the length of one run (``app``: the request's part). One at a time
    on a server (its SOCKS ports are fixed): a run that finds another holding them waits, then goes without."""

    def __init__(self, app: Dict[str, Any]) -> None:
        self.app = app
        self.dir = ""
        self.proc = None  # type: Optional[subprocess.Popen[bytes]]
        self.error = ""
        self.lock = None  # type: Optional[Any]

    def _take_lock(self, wait: float) -> bool:
        import fcntl

        self.lock = open(os.path.join(tempfile.gettempdir(), "reconciler-probe.lock"), "a")
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(self.lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)

    def __enter__(self) -> "AppClient":
        try:
            if not self._take_lock(8.0):
                self.error = "another probe run holds the probe client's ports"
                return self
            _sweep()
            self.dir = tempfile.mkdtemp(prefix="reconciler-probe-")
            config = os.path.join(self.dir, os.path.basename(self.app["file"]))
            fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.app["config"])
            argv = [str(a).replace("{config}", config).replace("{dir}", self.dir) for a in self.app["argv"]]
            self.log = open(os.path.join(self.dir, "client.log"), "wb")
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                         cwd=self.dir, start_new_session=True, preexec_fn=_die_with_parent)
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.error = ("the probe client did not start: %s" % e)[:200]
        return self

    def wait_ready(self, ports: List[int], timeout: float) -> None:
        """Until every SOCKS port listens, the client exits, or ``timeout``."""
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout
        pending = sorted(set(ports))
        while pending and time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            port = pending[0]
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                pending.pop(0)
                continue
            except OSError:
                time.sleep(0.03)
        if self.proc.poll() is not None:  # its log is not quoted: a parse error may echo the configuration
            self.error = "the probe client exited with code %s (run its own check on the server)" % self.proc.returncode
        elif pending:
            self.error = "the probe client did not listen within %gs" % timeout

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(3)
        if getattr(self, "log", None):
            self.log.close()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self.lock is not None:
            self.lock.close()


async def probe_all(probes: List[Dict[str, Any]], timeout: float, parallel: int = 64,
                    app: Optional[Dict[str, Any]] = None, app_error: str = "") -> Dict[str, Dict[str, Any]]:
    sem = asyncio.Semaphore(parallel)
    ports = (app or {}).get("ports") or {}

    async def one(p: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
        async with sem:
            result = await probe(p, timeout)
        port = ports.get(p["id"])
        if port is not None and result["ok"]:  # a target the handshake already fails needs no session to fail
            if app_error:
                result["app"] = {"local": app_error}
            else:
                async with sem:
                    result["app"] = await app_probe(int(port), app or {})
        return p["id"], result

    return dict(await asyncio.gather(*(one(p) for p in probes)))


def run_probes(req: Dict[str, Any], timeout: float) -> Dict[str, Dict[str, Any]]:
    probes = req.get("probes", [])
    app = req.get("app")
    if not app or not probes:
        return asyncio.run(probe_all(probes, timeout))
    import signal

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # the client is stopped and its folder removed on the way out

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, stop)
    with AppClient(app) as client:
        if not client.error:
            client.wait_ready([int(p) for p in (app.get("ports") or {}).values()], 5.0)
        return asyncio.run(probe_all(probes, timeout, app=app, app_error=client.error))


def main() -> None:
    req = json.load(sys.stdin)
    timeout = float(req.get("timeout", 3.0))
    started = time.time()
    traffic, users, conns, devices = (None, [], 0, {})  # type: Optional[Dict[str, int]], List[str], int, Dict[str, List[str]]
    if req.get("clash_api"):
        traffic, users, conns, devices = clash_connections(req["clash_api"], req.get("clash_secret", ""), timeout,
                                                           req.get("device_salt", ""))
    usage = usage_counters(req["usage_table"], req.get("usage_load", ""), 10) if req.get("usage_table") else None
    out = {
        "agent": AGENT_VERSION,
        "time": started,
        "service": service_state(req.get("service", "sing-box.service")),
        "listeners": listening([tuple(x) for x in req.get("listeners", [])], str(req.get("root", "/"))),
        "traffic": traffic,
        "users": users,
        "connections": conns,
        "devices": devices,
        "usage": usage,
        "probes": run_probes(req, timeout),
        "took_ms": 0,
    }
    out["took_ms"] = round((time.time() - started) * 1000, 1)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
