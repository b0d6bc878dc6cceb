"""The three document formats clients accept. Pure functions of ``ClientOutbound`` lists.

- ``links``: base64 of one share link per line, as v2rayN/v2rayNG, Hiddify,
  Streisand and Shadowrocket read them (``vless://``, ``trojan://``, SIP002
  ``ss://``, ``hysteria2://``, ``tuic://``);
- ``sing-box``: a complete client configuration — one outbound per entry
  tagged with the entry's name, a selector, a local mixed proxy, DNS through
  the proxy and sane routing defaults (sing-box 1.12+ schema);
- ``clash``: a Clash Meta / Mihomo profile with the proxies and a select group.
"""

from __future__ import annotations

import base64
import json
import re
from urllib.parse import quote, urlencode

from reconciler.subscriptions.outbound import ClientOutbound

FORMATS = ("links", "sing-box", "clash")


# --------------------------------------------------------------------------- share links


def share_link(o: ClientOutbound) -> str:
    tag = "#" + quote(o.name, safe="")
    if o.protocol in ("vless-reality", "vless-tls"):
        q: dict[str, str] = {"encryption": "none", "type": "tcp"}
        if o.flow:
            q["flow"] = o.flow
        if o.protocol == "vless-reality":
            q.update(security="reality", sni=o.sni, fp=o.fingerprint, pbk=o.public_key, sid=o.short_id)
        else:
            q.update(security="tls", sni=o.sni, fp=o.fingerprint or "chrome")
            if o.self_signed:
                q["allowInsecure"] = "1"
        return f"vless://{o.uuid}@{o.url_host}:{o.port}?{urlencode(q)}{tag}"
    if o.protocol == "trojan":
        q = {"security": "tls", "sni": o.sni, "type": "tcp"}
        if o.self_signed:
            q["allowInsecure"] = "1"
        return f"trojan://{quote(o.password, safe='')}@{o.url_host}:{o.port}?{urlencode(q)}{tag}"
    if o.protocol == "shadowsocks-2022":
        userinfo = base64.urlsafe_b64encode(f"{o.method}:{o.password}".encode()).rstrip(b"=").decode()
        return f"ss://{userinfo}@{o.url_host}:{o.port}{tag}"
    if o.protocol == "hysteria2":
        q = {"sni": o.sni}
        if o.self_signed:
            q["insecure"] = "1"
        return f"hysteria2://{quote(o.password, safe='')}@{o.url_host}:{o.port}/?{urlencode(q)}{tag}"
    if o.protocol == "tuic":
        q = {"congestion_control": o.congestion_control, "alpn": ",".join(o.alpn), "sni": o.sni, "udp_relay_mode": "native"}
        if o.self_signed:
            q["allow_insecure"] = "1"
        return f"tuic://{o.uuid}:{quote(o.password, safe='')}@{o.url_host}:{o.port}?{urlencode(q)}{tag}"
    raise ValueError(f"no share link for {o.protocol}")


def links(outbounds: list[ClientOutbound]) -> bytes:
    text = "\n".join(share_link(o) for o in outbounds) + ("\n" if outbounds else "")
    return base64.b64encode(text.encode())


# --------------------------------------------------------------------------- sing-box


def _unique_tags(outbounds: list[ClientOutbound]) -> list[str]:
    seen: dict[str, int] = {}
    tags = []
    for o in outbounds:
        n = seen.get(o.name, 0) + 1
        seen[o.name] = n
        tags.append(o.name if n == 1 else f"{o.name} ({n})")
    return tags


def _singbox_tls(o: ClientOutbound) -> dict[str, object]:
    tls: dict[str, object] = {"enabled": True, "server_name": o.sni}
    if o.insecure:
        tls["insecure"] = True
    if o.pin_sha256:
        tls["certificate_public_key_sha256"] = [o.pin_sha256]
    if o.alpn:
        tls["alpn"] = list(o.alpn)
    return tls


def singbox_outbound(o: ClientOutbound, tag: str) -> dict[str, object]:
    base: dict[str, object] = {"tag": tag, "server": o.host, "server_port": o.port}
    if o.protocol == "vless-reality":
        out = {"type": "vless", **base, "uuid": o.uuid, "flow": o.flow,
               "tls": {"enabled": True, "server_name": o.sni, "utls": {"enabled": True, "fingerprint": o.fingerprint},
                       "reality": {"enabled": True, "public_key": o.public_key, "short_id": o.short_id}}}
    elif o.protocol == "vless-tls":
        out = {"type": "vless", **base, "uuid": o.uuid, "flow": o.flow, "tls": _singbox_tls(o)}
    elif o.protocol == "trojan":
        out = {"type": "trojan", **base, "password": o.password, "tls": _singbox_tls(o)}
    elif o.protocol == "shadowsocks-2022":
        out = {"type": "shadowsocks", **base, "method": o.method, "password": o.password}
    elif o.protocol == "hysteria2":
        out = {"type": "hysteria2", **base, "password": o.password, "tls": _singbox_tls(o)}
    elif o.protocol == "tuic":
        out = {"type": "tuic", **base, "uuid": o.uuid, "password": o.password,
               "congestion_control": o.congestion_control, "tls": _singbox_tls(o)}
    else:
        raise ValueError(o.protocol)
    if not out.get("flow", True):
        out.pop("flow")
    return out


def singbox(outbounds: list[ClientOutbound], mixed_port: int = 2080) -> bytes:
    tags = _unique_tags(outbounds)
    config = {
        "log": {"level": "warn"},
        "dns": {
            "servers": [
                {"type": "https", "tag": "remote", "server": "1.1.1.1", "detour": "proxy"},
                {"type": "local", "tag": "local"},
            ],
            "final": "remote",
            "strategy": "prefer_ipv4",
        },
        "inbounds": [{"type": "mixed", "tag": "mixed-in", "listen": "127.0.0.1", "listen_port": mixed_port}],
        "outbounds": [
            {"type": "selector", "tag": "proxy", "outbounds": tags or ["direct"], "default": (tags or ["direct"])[0]},
            *[singbox_outbound(o, t) for o, t in zip(outbounds, tags, strict=True)],
            {"type": "direct", "tag": "direct"},
        ],
        "route": {
            "rules": [
                {"action": "sniff"},
                {"protocol": "dns", "action": "hijack-dns"},
                {"ip_is_private": True, "outbound": "direct"},
            ],
            "final": "proxy",
            "auto_detect_interface": True,
            "default_domain_resolver": "local",
        },
    }
    # Compact: the C encoder (indent falls back to the pure-Python one, 5x slower); clients do not read whitespace.
    return (json.dumps(config, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


# --------------------------------------------------------------------------- Clash Meta / Mihomo


def clash_proxy(o: ClientOutbound, name: str) -> dict[str, object]:
    base: dict[str, object] = {"name": name, "server": o.host, "port": o.port, "udp": True}
    if o.protocol in ("vless-reality", "vless-tls"):
        p = {**base, "type": "vless", "uuid": o.uuid, "network": "tcp", "tls": True, "servername": o.sni,
             "client-fingerprint": o.fingerprint or "chrome"}
        if o.flow:
            p["flow"] = o.flow
        if o.protocol == "vless-reality":
            p["reality-opts"] = {"public-key": o.public_key, "short-id": o.short_id}
        elif o.self_signed:
            p["skip-cert-verify"] = True
        return p
    if o.protocol == "trojan":
        return {**base, "type": "trojan", "password": o.password, "sni": o.sni, "skip-cert-verify": o.self_signed}
    if o.protocol == "shadowsocks-2022":
        return {**base, "type": "ss", "cipher": o.method, "password": o.password}
    if o.protocol == "hysteria2":
        return {**base, "type": "hysteria2", "password": o.password, "sni": o.sni, "skip-cert-verify": o.self_signed,
                "alpn": list(o.alpn)}
    if o.protocol == "tuic":
        return {**base, "type": "tuic", "uuid": o.uuid, "password": o.password, "sni": o.sni, "alpn": list(o.alpn),
                "congestion-controller": o.congestion_control, "udp-relay-mode": "native", "skip-cert-verify": o.self_signed}
    raise ValueError(o.protocol)


def clash(outbounds: list[ClientOutbound]) -> bytes:
    names = _unique_tags(outbounds)
    doc = {
        "mixed-port": 7890,
        "allow-lan": False,
        "mode": "rule",
        "log-level": "warning",
        "proxies": [clash_proxy(o, n) for o, n in zip(outbounds, names, strict=True)],
        "proxy-groups": [{"name": "PROXY", "type": "select", "proxies": names or ["DIRECT"]}],
        "rules": ["MATCH,PROXY"],
    }
    return _block_yaml(doc).encode()


# Characters JSON leaves raw that YAML reads otherwise: DEL and the C1 controls are not printable, and
# NEL, LS and PS are line breaks (folded inside quoted scalars); the BOM is not allowed inside a document.
_NOT_YAML_PRINTABLE = re.compile("[\x7f-\x9f\u2028\u2029\ufeff]")
_PLAIN_KEY = re.compile(r"^[a-z][a-z0-9-]*$")


def _scalar(value: object) -> str:
    """A JSON scalar is a YAML flow scalar: strings become double-quoted scalars with JSON's escapes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = json.dumps(value, ensure_ascii=False)
    return _NOT_YAML_PRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", text) if isinstance(value, str) else text


def _flow(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    return _scalar(value)


def _key(key: str) -> str:
    return key if _PLAIN_KEY.match(key) else _scalar(key)


def _block_yaml(doc: dict[str, object]) -> str:
    """The profile as Clash users write it: top-level keys in block style, one flow mapping per list item.

    ruamel's emitter took ~3 ms per profile (most of a 100k-user write); this shape is fixed, so the
    emitter is exact and small. The tests parse its output with ruamel and check it round-trips.
    """
    lines = []
    for key, value in doc.items():
        if isinstance(value, list) and value:
            lines.append(f"{_key(key)}:")
            lines.extend(f"  - {_flow(item)}" for item in value)
        else:
            lines.append(f"{_key(key)}: {_flow(value)}")
    return "\n".join(lines) + "\n"
