"""The client's address of a live request behind trusted proxies (STEER-4). Pure.

A request's peer is the client unless the peer is one of the operator's trusted proxies
(``settings.outputs.trusted_proxies``: addresses or networks). Only then are the headers read:

1. a CDN's own header (``CF-Connecting-IP``, ``True-Client-IP``), which the CDN sets and overwrites;
2. else ``Forwarded`` (RFC 7239, its ``for=`` parameters) or ``X-Forwarded-For``: the addresses are walked
   from the right (the nearest hop) to the left, past every trusted proxy; the first untrusted one is the
   client. Anything left of it was written by the client and is never believed.

A header that is malformed where it matters (a garbled hop, ``unknown``, an obfuscated name) stops the walk:
the last address known is used, never a guess. At most ``MAX_HOPS`` hops are read.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_HOPS = 32
CDN_HEADERS = ("CF-Connecting-IP", "True-Client-IP")
_FOR = re.compile(r'(?:^|;)\s*for\s*=\s*("(?:[^"\\]|\\.)*"|[^;,\s]+)', re.I)


def networks(items: Sequence[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(item, strict=False) for item in items)


def _address(text: str) -> Address | None:
    text = text.strip().strip('"')
    if text.startswith("["):  # Forwarded's "[2001:db8::1]:4711"
        text = text[1:text.find("]")] if "]" in text else ""
    elif text.count(":") == 1:  # "192.0.2.1:4711"
        text = text.split(":", 1)[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _trusted(address: Address, trusted: tuple[Network, ...]) -> bool:
    return any(address in net for net in trusted)


def _hops(headers: Mapping[str, str]) -> list[str] | None:
    forwarded = headers.get("Forwarded")
    if forwarded:
        hops = []
        for element in forwarded.split(",")[-MAX_HOPS:]:
            match = _FOR.search(element)
            hops.append(match.group(1) if match else "")
        return hops
    xff = headers.get("X-Forwarded-For")
    return xff.split(",")[-MAX_HOPS:] if xff else None


def client_address(peer: str, headers: Mapping[str, str], trusted: tuple[Network, ...]) -> str:
    """The client's address: ``peer`` itself unless it is a trusted proxy (see the module's docstring)."""
    known = _address(peer)
    if known is None or not trusted or not _trusted(known, trusted):
        return peer
    for name in CDN_HEADERS:
        value = headers.get(name)
        if value is not None:
            cdn = _address(value)
            return str(cdn) if cdn is not None else peer
    for hop in reversed(_hops(headers) or []):
        address = _address(hop)
        if address is None:
            break  # malformed or hidden: the nearest address known stands
        known = address
        if not _trusted(address, trusted):
            break
    return str(known)


def connection_key(peer: str, trusted: tuple[Network, ...], loopback_is_proxy: bool = False) -> str | None:
    """Whose connection this is, for a listener's cap per client: the peer's address, an IPv6 one by its /64 (one host
    often holds a whole /64) and an IPv4-mapped one as the IPv4 address. None for a trusted proxy — it carries many
    clients over its connections, and which client a connection is for is known from its requests' headers only,
    after the connection is taken — for a loopback peer when ``loopback_is_proxy`` (a reverse proxy on this host),
    and for a peer that is not an address (a Unix socket)."""
    try:
        address: Address = ipaddress.ip_address(peer)  # a socket's peer: a bare address
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if (trusted and _trusted(address, trusted)) or (loopback_is_proxy and address.is_loopback):
        return None
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)
