"""The three document formats clients accept. Pure functions of ``ClientOutbound`` lists.

- ``links``: base64 of one share link per line, as v2rayN/v2rayNG, Hiddify,
  Streisand and Shadowrocket read them (``vless://``, ``trojan://``, SIP002
  ``ss://``, ``hysteria2://``, ``tuic://``);
- ``sing-box``: a complete client profile — one outbound per entry tagged
  with the entry's name, a selector over them, a TUN inbound, DNS through
  the proxy and routing as the official client examples (sing-box 1.12+ schema);
- ``clash``: a Clash Meta / Mihomo profile with the proxies and a select group.

Failover inside the app (``settings.outputs.failover``): in the sing-box and Clash profiles, an entry with backups
is a group (Mihomo ``fallback``; sing-box ``urltest`` whose checks the responders delay by place, ``check_url``)
of the balanced choice first, then its backups in the balancer's order. Share links stay one entry per route.

``omission`` decides, per format, which entries cannot be given without
telling clients to skip verification.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Callable
from urllib.parse import quote, urlencode

from reconciler.model.cluster import FailoverSettings, SplitSettings
from reconciler.model.types import order_id
from reconciler.subscriptions.outbound import ClientOutbound

RESPONDER = "127.0.0.1:9097"  # every server's probe responder, on its loopback (reconciler.engine.base)
TOLERANCE_MS = 150  # sing-box's urltest: a member must be this much faster to displace the one in use

FORMATS = ("links", "sing-box", "clash")


# --------------------------------------------------------------------------- verification


def omission(o: ClientOutbound, fmt: str) -> str | None:
    """Why ``o`` is left out of ``fmt`` (a clause for the operator), or None: ``fmt`` can verify its server.

    No format skips verification unless the inbound says ``tls.insecure: true``; a self-signed certificate
    is pinned where the format can pin, with what an apply learnt (``outbound.pins_of``)."""
    if o.verify != "pinned":
        return None
    later = "is learnt when an apply reads the certificate back (run `reconciler apply`)"
    if fmt == "sing-box":
        return None if o.spki_pin else f"its self-signed certificate's public-key pin {later}"
    if fmt == "clash" or o.protocol == "hysteria2":  # Mihomo's `fingerprint`, Hysteria2's `pinSHA256`
        return None if o.cert_sha256 else f"its self-signed certificate's SHA-256 fingerprint {later}"
    return (f"{o.protocol} share links have no way to pin a self-signed certificate "
            "(give the inbound a certificate, or accept the risk with `tls.insecure: true`)")


# --------------------------------------------------------------------------- share links


def _ss_userinfo(o: ClientOutbound) -> str:
    # SIP002 with SIP022 (2022 ciphers): userinfo in plain text, method and password percent-encoded, never base64.
    return f"{quote(o.method, safe='')}:{quote(o.password, safe='')}"


def share_link(o: ClientOutbound) -> str:
    """One link by its scheme's convention (the parameter names v2rayN, NekoBox, Hiddify and Mihomo read);
    ``omission`` must have let ``o`` through for links."""
    tag = "#" + quote(o.name, safe="")
    insecure = o.verify == "insecure"
    if o.protocol in ("vless-reality", "vless-tls"):
        q: dict[str, str] = {"encryption": "none", "type": "tcp"}
        if o.flow:
            q["flow"] = o.flow
        if o.protocol == "vless-reality":  # uTLS: `fp` only where the profile imitates a browser
            q.update(security="reality", sni=o.sni, fp=o.fingerprint, pbk=o.public_key, sid=o.short_id)
        else:
            q.update(security="tls", sni=o.sni)
            if insecure:
                q["allowInsecure"] = "1"
        return f"vless://{quote(o.uuid, safe='')}@{o.url_host}:{o.port}?{urlencode(q)}{tag}"
    if o.protocol == "trojan":
        q = {"security": "tls", "sni": o.sni, "type": "tcp"}
        if insecure:
            q["allowInsecure"] = "1"
        return f"trojan://{quote(o.password, safe='')}@{o.url_host}:{o.port}?{urlencode(q)}{tag}"
    if o.protocol == "shadowsocks-2022":
        return f"ss://{_ss_userinfo(o)}@{o.url_host}:{o.port}{tag}"
    if o.protocol == "hysteria2":
        q = {"sni": o.sni}
        if insecure:
            q["insecure"] = "1"
        elif o.verify == "pinned":
            q["pinSHA256"] = o.cert_sha256  # the certificate's SHA-256 in hex (Hysteria2 URI scheme)
        return f"hysteria2://{quote(o.password, safe='')}@{o.url_host}:{o.port}/?{urlencode(q)}{tag}"
    if o.protocol == "tuic":
        q = {"congestion_control": o.congestion_control, "udp_relay_mode": "native", "alpn": ",".join(o.alpn), "sni": o.sni}
        if insecure:
            q["allow_insecure"] = "1"
        return f"tuic://{quote(o.uuid, safe='')}:{quote(o.password, safe='')}@{o.url_host}:{o.port}?{urlencode(q)}{tag}"
    raise ValueError(f"no share link for {o.protocol}")


def links_text(outbounds: list[ClientOutbound]) -> bytes:
    """The links, one a line, before base64 (credentials percent-encoded where they stand)."""
    return ("\n".join(share_link(o) for o in outbounds) + ("\n" if outbounds else "")).encode()


def links(outbounds: list[ClientOutbound]) -> bytes:
    return base64.b64encode(links_text(outbounds))


# --------------------------------------------------------------------------- failover inside the app


def check_url(members: list[ClientOutbound], failover: FailoverSettings, ordered: bool = True) -> str:
    """The members' health check: the padded answer of the responder behind each (so a stalled flow fails it).
    ``ordered``: with the order (``?o=``): each server's responder answers later by its place, which makes an app
    that picks by delay (sing-box's ``urltest``) keep the order and come back to the first when it recovers. An app
    that keeps the written order itself (Mihomo's ``fallback``) gets no delays (its check timeout is 5 s)."""
    url = f"http://{RESPONDER}/pad/{failover.check_bytes}"
    return url + "?o=" + ".".join(dict.fromkeys(order_id(m.inbound) for m in members)) if ordered else url


def _member_names(groups: list[list[ClientOutbound]]) -> tuple[list[str], list[list[str]]]:
    """Entry names (the first member's, ROUTE-2) and, for a group of several, its members' names (their place in
    the order shown: ``NL Amsterdam [2]``); all unique in the document."""
    names = _unique_tags([g[0] for g in groups])
    taken = set(names)
    members: list[list[str]] = []
    for group in groups:
        inner = []
        if len(group) > 1:
            for k, o in enumerate(group, 1):
                tag, n = f"{o.name} [{k}]", 1
                while tag in taken:
                    n += 1
                    tag = f"{o.name} [{k}.{n}]"
                taken.add(tag)
                inner.append(tag)
        members.append(inner)
    return names, members


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
    if o.verify == "insecure":
        tls["insecure"] = True
    elif o.verify == "pinned":
        tls["certificate_public_key_sha256"] = [o.spki_pin]
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
               "congestion_control": o.congestion_control, "udp_relay_mode": "native", "tls": _singbox_tls(o)}
    else:
        raise ValueError(o.protocol)
    if not out.get("flow", True):
        out.pop("flow")
    return out


# The TUN interface's addresses, as sing-box's own client examples give them.
TUN_ADDRESSES = ["172.19.0.1/30", "fdfe:dcba:9876::1/126"]


def _singbox_split(split: SplitSettings | None) -> tuple[list[dict[str, object]], list[dict[str, object]], list[dict[str, object]]]:
    """Split tunnelling as sing-box writes it: (route rules, DNS rules, rule sets). Remote binary rule sets, fetched
    by the app through the VPN (a blocked network may block their host) and refreshed by it."""
    if split is None:
        return [], [], []
    sets: list[dict[str, object]] = [
        {"tag": f"geoip-{cc.lower()}", "type": "remote", "format": "binary", "download_detour": "proxy",
         "url": split.geoip_sing_box.replace("{country}", cc.lower())} for cc in split.countries]
    sets += [{"tag": rs.name, "type": "remote", "format": "binary", "download_detour": "proxy", "url": rs.sing_box}
             for rs in split.rule_sets]
    rules: list[dict[str, object]] = []
    dns: list[dict[str, object]] = []
    if split.domains:
        rules.append({"domain_suffix": list(split.domains), "outbound": "direct"})
        dns.append({"domain_suffix": list(split.domains), "server": "local"})
    if sets:
        rules.append({"rule_set": [str(x["tag"]) for x in sets], "outbound": "direct"})
    domain_sets = [rs.name for rs in split.rule_sets if rs.behavior == "domain"]
    if domain_sets:
        dns.append({"rule_set": domain_sets, "server": "local"})  # names that go direct are resolved there too
    return rules, dns, sets


def singbox(outbounds: list[ClientOutbound], split: SplitSettings | None = None,
            groups: list[list[ClientOutbound]] | None = None, failover: FailoverSettings | None = None) -> bytes:
    """A profile a phone or desktop app (SFA, SFI, SFM, Hiddify) runs as it is: a TUN inbound that takes the
    device's traffic, DNS through the proxy, sniffing and DNS hijacking by rule actions, private addresses
    direct, the operator's split tunnelling (``settings.split``) direct, everything else to the selector of the
    routes' entries (sing-box 1.12+ schema, as the official client examples of 1.14 write it). No local proxy
    port: another app on the device could use or find it."""
    groups = groups or [[o] for o in outbounds]
    tags, member_tags = _member_names(groups)
    entries: list[str] = []  # each outbound's JSON (a member's the same in thousands of documents: cached)
    for tag, group, inner in zip(tags, groups, member_tags, strict=True):
        if not inner or failover is None:
            entries.append(_singbox_outbound_json(group[0], tag))
            continue
        # An order that keeps the first member while it works and comes back to it: urltest picks by delay, and the
        # responders' answers are delayed by place (``check_url``); the tolerance keeps jitter from reordering.
        entries.append(_json({"type": "urltest", "tag": tag, "outbounds": inner, "url": check_url(group, failover),
                              "interval": f"{failover.check_interval:g}s", "tolerance": TOLERANCE_MS,
                              "interrupt_exist_connections": True}))
        entries += [_singbox_outbound_json(o, t) for o, t in zip(group, inner, strict=True)]
    served = bool(tags)
    head, tail = _frame("sing-box", split, served, lambda: _singbox_frame(split, served))
    outbounds_json = [
        _json({"type": "selector", "tag": "proxy", "outbounds": tags or ["direct"], "default": (tags or ["direct"])[0]}),
        *entries,
        _DIRECT_JSON,
    ]
    # One JSON object, {head, "outbounds": [...], tail}, written in its three parts: json.dumps of the whole, to the
    # byte (compact: separators without spaces, clients do not read whitespace; the C encoder).
    return ("{" + head + ',"outbounds":[' + ",".join(outbounds_json) + "]," + tail + "}\n").encode()


def _frame(fmt: str, split: SplitSettings | None, served: bool, make: Callable[[], tuple[str, str]]) -> tuple[str, str]:
    """A profile's text before its entries and after them, the same in every document of a snapshot: made once
    per split settings (``make``) and kept by the settings' identity, the object held beside its text (so its id
    is not reused meanwhile); past a few dozen (settings long gone), all made again."""
    key = (fmt, id(split), served)
    found = _FRAMES.get(key)
    if found is not None and found[0] is split:
        return found[1], found[2]
    before, after = make()
    if len(_FRAMES) >= 64:
        _FRAMES.clear()
    _FRAMES[key] = (split, before, after)
    return before, after


_FRAMES: dict[tuple[str, int, bool], tuple[object, str, str]] = {}  # (format, id(split), served) → (split, before, after)


def _singbox_frame(split: SplitSettings | None, served: bool) -> tuple[str, str]:
    """What a profile has before its outbounds and after them (``served``: it has an entry), as JSON without its
    outer braces (``_frame`` keeps it)."""
    split_rules, split_dns, rule_sets = _singbox_split(split)
    head = {
        "log": {"level": "warn"},
        "dns": {
            "servers": [
                {"type": "https", "tag": "remote", "server": "1.1.1.1", "detour": "proxy"},
                {"type": "local", "tag": "local"},
            ],
            **({"rules": split_dns} if split_dns else {}),
            "final": "remote",
            "strategy": "prefer_ipv4",
        },
        "inbounds": [{"type": "tun", "tag": "tun-in", "address": TUN_ADDRESSES, "auto_route": True, "strict_route": True}],
    }
    tail = {
        "route": {
            "rules": [
                {"action": "sniff"},
                {"protocol": "dns", "action": "hijack-dns"},
                {"ip_is_private": True, "outbound": "direct"},
                *split_rules,
                # No entry the user can verify: the device's traffic is refused, never sent `direct` unprotected.
                *([] if served else [{"action": "reject"}]),
            ],
            **({"rule_set": rule_sets} if rule_sets else {}),
            "final": "proxy",
            "auto_detect_interface": True,
            "default_domain_resolver": "local",
        },
        # The user's choice in the selector survives a restart of the app.
        "experimental": {"cache_file": {"enabled": True}},
    }
    return _json(head)[1:-1], _json(tail)[1:-1]


def _compact_encoder() -> Callable[[object], str]:
    """``json.dumps(value, ensure_ascii=False, separators=(",", ":"))``, from one C encoder made once: a ``JSONEncoder``
    makes one on every call (half of the 2.8 µs of a failover group's JSON, made for thousands of templates a pass).
    Without the check for cycles: documents are trees."""
    plain = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False)
    make = getattr(json.encoder, "c_make_encoder", None)  # (not in the typing stubs)
    if make is None:  # (no C accelerator: the encoder's own way)
        return plain.encode
    encode = make(None, plain.default, json.encoder.encode_basestring, None, ":", ",", False, False, True)
    return lambda value: "".join(encode(value, 0))


_json = _compact_encoder()
_DIRECT_JSON = _json({"type": "direct", "tag": "direct"})


@functools.lru_cache(maxsize=4096)
def _singbox_outbound_json(o: ClientOutbound, tag: str) -> str:
    return _json(singbox_outbound(o, tag))


# --------------------------------------------------------------------------- Clash Meta / Mihomo


def _clash_verify(o: ClientOutbound) -> dict[str, object]:
    if o.verify == "insecure":
        return {"skip-cert-verify": True}
    if o.verify == "pinned":
        return {"fingerprint": o.cert_sha256}  # Mihomo: the certificate's SHA-256 in hex
    return {}


def clash_proxy(o: ClientOutbound, name: str) -> dict[str, object]:
    base: dict[str, object] = {"name": name, "server": o.host, "port": o.port, "udp": True}
    if o.protocol in ("vless-reality", "vless-tls"):
        p = {**base, "type": "vless", "uuid": o.uuid, "network": "tcp", "tls": True, "servername": o.sni}
        if o.flow:
            p["flow"] = o.flow
        if o.protocol == "vless-reality":
            p["client-fingerprint"] = o.fingerprint
            p["reality-opts"] = {"public-key": o.public_key, "short-id": o.short_id}
        return {**p, **_clash_verify(o)}
    if o.protocol == "trojan":
        return {**base, "type": "trojan", "password": o.password, "sni": o.sni, **_clash_verify(o)}
    if o.protocol == "shadowsocks-2022":
        return {**base, "type": "ss", "cipher": o.method, "password": o.password}
    if o.protocol == "hysteria2":
        return {**base, "type": "hysteria2", "password": o.password, "sni": o.sni, "alpn": list(o.alpn), **_clash_verify(o)}
    if o.protocol == "tuic":
        return {**base, "type": "tuic", "uuid": o.uuid, "password": o.password, "sni": o.sni, "alpn": list(o.alpn),
                "congestion-controller": o.congestion_control, "udp-relay-mode": "native", **_clash_verify(o)}
    raise ValueError(o.protocol)


def _clash_split(split: SplitSettings | None) -> tuple[list[str], dict[str, object]]:
    """Split tunnelling as Mihomo writes it: (rules, rule-providers): remote .mrs rule sets fetched through PROXY."""
    if split is None:
        return [], {}
    providers: dict[str, object] = {}
    for name, behavior, url in [(f"geoip-{cc.lower()}", "ipcidr", split.geoip_clash.replace("{country}", cc.lower()))
                                for cc in split.countries] + [(rs.name, rs.behavior, rs.clash) for rs in split.rule_sets]:
        providers[name] = {"type": "http", "behavior": behavior, "format": "mrs", "url": url,
                           "path": f"./rule-sets/{name}.mrs", "interval": 86400, "proxy": "PROXY"}
    # IP rule sets match addresses only (no-resolve): a name is never resolved locally just to test it (a DNS leak)
    rules = [f"DOMAIN-SUFFIX,{d},DIRECT" for d in split.domains] + [
        f"RULE-SET,{name},DIRECT" + (",no-resolve" if p["behavior"] == "ipcidr" else "")  # type: ignore[index]
        for name, p in providers.items()]
    return rules, providers


def clash(outbounds: list[ClientOutbound], split: SplitSettings | None = None,
          groups: list[list[ClientOutbound]] | None = None, failover: FailoverSettings | None = None) -> bytes:
    groups = groups or [[o] for o in outbounds]
    names, member_names = _member_names(groups)
    proxies: list[_Flow] = []
    fallbacks: list[dict[str, object]] = []
    for name, group, inner in zip(names, groups, member_names, strict=True):
        if not inner or failover is None:
            proxies.append(_clash_proxy_flow(group[0], name))
            continue
        # Mihomo's fallback: the first member, in the written order, whose last check passed; back to it when it does.
        proxies += [_clash_proxy_flow(o, n) for o, n in zip(group, inner, strict=True)]
        fallbacks.append({"name": name, "type": "fallback", "proxies": inner, "url": check_url(group, failover, False),
                          "interval": max(1, round(failover.check_interval)), "timeout": 5000, "lazy": True})
    before, after = _frame("clash", split, True, lambda: _clash_frame(split))
    # The profile's top-level keys each stand on lines of their own (``_block_yaml``): those around the proxies and
    # their groups are the same in every document of a snapshot.
    return (before + _block_yaml({
        "proxies": proxies,
        "proxy-groups": [{"name": "PROXY", "type": "select", "proxies": names or ["REJECT"]},  # never DIRECT unprotected
                         *fallbacks],
    }) + after).encode()


def _clash_frame(split: SplitSettings | None) -> tuple[str, str]:
    """A Clash profile's lines before its proxies and after their groups (``_frame`` keeps them)."""
    split_rules, providers = _clash_split(split)
    return (_block_yaml({"mixed-port": 7890, "allow-lan": False, "mode": "rule", "log-level": "warning"}),
            _block_yaml({**({"rule-providers": providers} if providers else {}), "rules": [*split_rules, "MATCH,PROXY"]}))


# Characters JSON leaves raw that YAML reads otherwise: DEL and the C1 controls are not printable, and
# NEL, LS and PS are line breaks (folded inside quoted scalars); the BOM is not allowed inside a document.
_NOT_YAML_PRINTABLE = re.compile("[\x7f-\x9f\u2028\u2029\ufeff]")
_PLAIN_KEY = re.compile(r"^[a-z][a-z0-9-]*$")
_json_string = json.encoder.encode_basestring


@functools.lru_cache(maxsize=16384, typed=True)  # (typed: True is "true", 1 is "1"; names and URLs recur in thousands of profiles)
def _scalar(value: object) -> str:
    """A JSON scalar is a YAML flow scalar: strings become double-quoted scalars with JSON's escapes."""
    if isinstance(value, str):  # json.dumps(value, ensure_ascii=False) is this very C function, through two calls
        return _NOT_YAML_PRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", _json_string(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, ensure_ascii=False)


class _Flow(str):
    """A value already written as a YAML flow node (``_flow`` puts it in as it is)."""


@functools.lru_cache(maxsize=4096)
def _clash_proxy_flow(o: ClientOutbound, name: str) -> _Flow:
    """A proxy's flow mapping: the same few (an inbound with stand-in credentials, under its name in the order) are in
    thousands of a snapshot's documents, each ~30 µs to write."""
    return _Flow(_flow(clash_proxy(o, name)))


def _flow(value: object) -> str:
    if isinstance(value, str):  # (most values; lists made, not generators: the groups of thousands of templates)
        return value if type(value) is _Flow else _scalar(value)
    if isinstance(value, dict):
        return "{" + ", ".join([f"{_key(k)}: {_flow(v)}" for k, v in value.items()]) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join([_flow(v) for v in value]) + "]"
    return _scalar(value)


@functools.lru_cache(maxsize=1024)
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
