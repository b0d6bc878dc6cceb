"""What a client needs to connect to one chosen inbound: a neutral description
every renderer (share links, sing-box JSON, Clash/Mihomo YAML) formats its own way.

TLS verification (no format emits an unverified TLS entry silently) is one of:

- ``ca``: an operator-supplied certificate or one from the ACME CA (``tls.acme``), verified as usual;
- ``pinned``: a self-signed certificate derived from the master secret (``reconciler.certificates``), verified
  by its pins, known from the first render: its public key (``spki_pin``, what sing-box takes) and the whole
  certificate's SHA-256 (``cert_sha256``, what Hysteria2 links and Mihomo take). A format that has no pin
  leaves the entry out (``reconciler.subscriptions.formats.omission``);
- ``insecure``: the inbound says ``tls.insecure: true`` (``validate`` warns): clients skip verification.

The pins of an inbound travel in the snapshot as one record (``tls_pins[inbound]``, ``pin_record``): the SPKI
pin, a space, the certificate's SHA-256 in hex (``reconciler.fleet.reality`` derives them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypedDict

from reconciler.balance.decide import Entry
from reconciler.balance.snapshot import Snapshot
from reconciler.credentials import Secret, UserCredentials, reality_short_id, ss_server_key
from reconciler.model import InboundRef
from reconciler.model.cluster import TLS

Verify = Literal["", "ca", "pinned", "insecure"]  # "": no TLS of ours (REALITY, Shadowsocks)


@dataclass(frozen=True)
class ClientOutbound:
    name: str  # the chosen inbound's name (ROUTE-2)
    protocol: str  # vless-reality, vless-tls, trojan, shadowsocks-2022, hysteria2, tuic
    host: str
    port: int
    inbound: str = ""  # the inbound's id (for the operator's warnings)
    uuid: str = ""
    password: str = ""
    method: str = ""
    flow: str = ""
    sni: str = ""
    verify: Verify = ""
    spki_pin: str = ""  # base64 SHA-256 of the certificate's public key (sing-box)
    cert_sha256: str = ""  # hex SHA-256 of the certificate (Hysteria2 links' pinSHA256, Mihomo's fingerprint)
    fingerprint: str = ""  # uTLS fingerprint: REALITY only (the only profile that imitates a browser)
    public_key: str = ""
    short_id: str = ""
    alpn: tuple[str, ...] = ()
    congestion_control: str = ""

    @property
    def url_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host


def pin_record(spki_pin: str, cert_sha256: str) -> str:
    """The learnt pins of a self-signed certificate as one fact (``tls_pins``): what ``pins_of`` reads."""
    return f"{spki_pin} {cert_sha256}"


def pins_of(record: str) -> tuple[str, str]:
    """(SPKI pin, certificate SHA-256) from a ``tls_pins`` record; either is "" when not known."""
    spki, _, cert = record.strip().partition(" ")
    return spki, cert.strip().lower()


def self_signed(tls: TLS) -> bool:
    """The one place that decides whether clients of an inbound pin its certificate: it is derived from the master
    secret (no certificate of the operator's)."""
    return tls.certificate is None and not tls.acme


class _Address(TypedDict):
    name: str
    protocol: str
    host: str
    port: int
    inbound: str


class _Verify(TypedDict):
    sni: str
    verify: Verify
    spki_pin: str
    cert_sha256: str


def client_outbound(entry: Entry, snapshot: Snapshot, secret: Secret, creds: UserCredentials) -> ClientOutbound:
    ib = entry.ref.inbound
    return outbound_for(entry.ref, entry.name, secret, creds, snapshot.public_keys.get(ib.id, ""),
                        snapshot.tls_pins.get(ib.id, ""))


def outbound_for(ref: InboundRef, name: str, secret: Secret, creds: UserCredentials, public_key: str, pins: str,
                 unverified: bool = False) -> ClientOutbound:
    """How a client with ``creds`` reaches ``ref``, in an entry named ``name`` (``pins``: its ``tls_pins`` record).
    ``unverified``: skip TLS verification (the witnesses' probes: reachability, not trust)."""
    ib = ref.inbound
    base: _Address = {"name": name, "protocol": ib.protocol, "host": ref.server.host, "port": ib.port, "inbound": ib.id}
    if ib.protocol == "vless-reality":
        sid = (ib.short_ids or [reality_short_id(secret, ib.id, ib.rotate)])[-1]
        sni = ib.server_names[0] if ib.server_names else ib.camouflage  # the one name the REALITY server accepts
        return ClientOutbound(**base, uuid=creds.uuid, flow=ib.flow, sni=sni, fingerprint=ib.fingerprint,
                              public_key=public_key, short_id=sid)
    if ib.protocol == "shadowsocks-2022":
        password = f"{ss_server_key(secret, ib.id, ib.method)}:{creds.ss_key(ib.method)}"
        return ClientOutbound(**base, method=ib.method, password=password)
    tls = ib.tls
    spki, cert = pins_of(pins) if self_signed(tls) and not unverified else ("", "")
    how: Verify = "insecure" if tls.insecure or unverified else "pinned" if self_signed(tls) else "ca"
    verify: _Verify = {"sni": tls.server_name, "verify": how, "spki_pin": spki, "cert_sha256": cert}
    if ib.protocol == "vless-tls":
        return ClientOutbound(**base, **verify, uuid=creds.uuid, flow=ib.flow)
    if ib.protocol == "trojan":
        return ClientOutbound(**base, **verify, password=creds.password)
    if ib.protocol == "hysteria2":
        return ClientOutbound(**base, **verify, password=creds.password, alpn=("h3",))
    return ClientOutbound(**base, **verify, uuid=creds.uuid, password=creds.password, alpn=("h3",),
                          congestion_control=ib.congestion_control)
