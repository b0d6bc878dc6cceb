"""What a client needs to connect to one chosen inbound: a neutral description
every renderer (share links, sing-box JSON, Clash/Mihomo YAML) formats its own way.

TLS verification: an operator-supplied certificate is verified normally; a
self-signed one (made on the server) is pinned by its public key when the
snapshot knows the pin (sing-box), and otherwise — share links and Clash have
no portable pin — clients are told to skip verification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from reconciler.balance.decide import Entry
from reconciler.balance.snapshot import Snapshot
from reconciler.credentials import Secret, UserCredentials, reality_short_id, ss_server_key


@dataclass(frozen=True)
class ClientOutbound:
    name: str  # the chosen inbound's name (ROUTE-2)
    protocol: str  # vless-reality, vless-tls, trojan, shadowsocks-2022, hysteria2, tuic
    host: str
    port: int
    uuid: str = ""
    password: str = ""
    method: str = ""
    flow: str = ""
    sni: str = ""
    insecure: bool = False  # for clients that can pin (sing-box): skip verification only without a pin
    pin_sha256: str = ""  # base64 SHA-256 of the certificate's public key
    self_signed: bool = False  # clients that cannot pin (share links, Clash) must skip verification
    fingerprint: str = ""
    public_key: str = ""
    short_id: str = ""
    alpn: tuple[str, ...] = ()
    congestion_control: str = ""

    @property
    def url_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host


class _Address(TypedDict):
    name: str
    protocol: str
    host: str
    port: int


class _Verify(TypedDict):
    sni: str
    insecure: bool
    pin_sha256: str
    self_signed: bool


def client_outbound(entry: Entry, snapshot: Snapshot, secret: Secret, creds: UserCredentials) -> ClientOutbound:
    ib = entry.ref.inbound
    host = entry.ref.server.host
    base: _Address = {"name": entry.name, "protocol": ib.protocol, "host": host, "port": ib.port}
    if ib.protocol == "vless-reality":
        sid = (ib.short_ids or [reality_short_id(secret, ib.id)])[-1]
        return ClientOutbound(**base, uuid=creds.uuid, flow=ib.flow, sni=ib.camouflage, fingerprint=ib.fingerprint,
                              public_key=snapshot.public_keys.get(ib.id, ""), short_id=sid)
    if ib.protocol == "shadowsocks-2022":
        password = f"{ss_server_key(secret, ib.id, ib.method)}:{creds.ss_key(ib.method)}"
        return ClientOutbound(**base, method=ib.method, password=password)
    tls = ib.tls
    self_signed = tls.certificate is None
    pin = snapshot.tls_pins.get(ib.id, "") if self_signed else ""
    verify: _Verify = {"sni": tls.server_name, "insecure": tls.insecure or (self_signed and not pin), "pin_sha256": pin,
              "self_signed": self_signed or tls.insecure}
    if ib.protocol == "vless-tls":
        return ClientOutbound(**base, **verify, uuid=creds.uuid, flow=ib.flow, fingerprint="chrome")
    if ib.protocol == "trojan":
        return ClientOutbound(**base, **verify, password=creds.password)
    if ib.protocol == "hysteria2":
        return ClientOutbound(**base, **verify, password=creds.password, alpn=("h3",))
    return ClientOutbound(**base, **verify, uuid=creds.uuid, password=creds.password, alpn=("h3",),
                          congestion_control=ib.congestion_control)
