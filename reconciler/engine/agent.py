#!/usr/bin/env python3
"""The collection agent: one run per report interval on every server (HEALTH-1, HEALTH-4).

Python 3 standard library only: it is installed on the servers as a managed
file (``/usr/local/lib/reconciler/agent.py``) and never imports the reconciler.
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
  Version Negotiation packet (RFC 9000 §6) — a UDP round trip without keys.

Every probe and the whole run are bounded by the request's timeout.
"""

import asyncio
import hashlib
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from typing import Any, Dict, List, Optional, Set, Tuple  # typing's generics: the servers' Python may predate list[...]

AGENT_VERSION = 2  # 2: usage packed


def service_state(unit: str) -> str:
    try:
        r = subprocess.run(["systemctl", "is-active", unit], capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def listening(wanted: List[Tuple[int, str]]) -> Dict[str, bool]:
    try:
        out = subprocess.run(["ss", "-Hlntu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {f"{p}/{t}": False for p, t in wanted}
    have = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 5 and ":" in parts[4]:
            try:
                have.add((int(parts[4].rsplit(":", 1)[1]), parts[0]))
            except ValueError:
                pass
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
        rows = []
        for item in json.loads(r.stdout).get("nftables", []):
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
                if source:
                    seen.add(hashlib.sha256((salt + source).encode()).hexdigest()[:16])
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
                ctx = ssl.create_default_context()
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE  # reachability, not trust: self-signed and camouflage certificates
                if p.get("alpn"):
                    ctx.set_alpn_protocols(list(p["alpn"]))
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


async def probe_all(probes: List[Dict[str, Any]], timeout: float, parallel: int = 64) -> Dict[str, Dict[str, Any]]:
    sem = asyncio.Semaphore(parallel)

    async def one(p: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
        async with sem:
            return p["id"], await probe(p, timeout)

    return dict(await asyncio.gather(*(one(p) for p in probes)))


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
        "listeners": listening([tuple(x) for x in req.get("listeners", [])]),
        "traffic": traffic,
        "users": users,
        "connections": conns,
        "devices": devices,
        "usage": usage,
        "probes": asyncio.run(probe_all(req.get("probes", []), timeout)),
        "took_ms": 0,
    }
    out["took_ms"] = round((time.time() - started) * 1000, 1)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
