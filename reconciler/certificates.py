"""Self-signed TLS certificates derived from the master secret, and the pins clients check them by.

An inbound with TLS and no certificate of the operator's gets a certificate made here, on the controller, from
the master secret: a P-256 key whose scalar is derived like every other credential (stable for secret, inbound
and ``rotate``), and a certificate signed with deterministic ECDSA (RFC 6979), so every render gives the same
bytes and nothing drifts. Whoever holds the secret knows every pin, so subscriptions carry pinned TLS entries
from the first render, with no apply and no facts file, as they do REALITY's public keys; no engine has to
generate keys on the server (Mihomo cannot), and no server has to be read back.

- ``derived_certificate(secret, inbound, server_name, rotate)`` → ``Certificate`` (PEM certificate, PEM key);
- ``spki_pin(cert_pem)``: base64 SHA-256 of the certificate's public key (sing-box's
  ``certificate_public_key_sha256``);
- ``certificate_sha256(cert_pem)``: hex SHA-256 of the certificate (Hysteria2 links' ``pinSHA256``, Mihomo's
  ``fingerprint``).

Validity: from 2025-01-01 for ten years. Clients verify these certificates by their pin, never by a chain.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from cryptography.x509.oid import NameOID

from reconciler.credentials import Secret

NOT_BEFORE = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
VALID_DAYS = 3650
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


@dataclass(frozen=True)
class Certificate:
    """A certificate and its key, PEM. ``repr`` hides the key."""

    cert_pem: str
    key_pem: str = field(repr=False)

    @cached_property  # the loop asks at every interval; the certificate itself is cached (derived_certificate)
    def spki_pin(self) -> str:
        return spki_pin(self.cert_pem)

    @cached_property
    def sha256(self) -> str:
        return certificate_sha256(self.cert_pem)


@lru_cache(maxsize=1024)  # ~1 ms a certificate; the loop renders every TLS inbound's pins at every interval
def derived_certificate(secret: Secret, inbound_id: str, server_name: str, rotate: int = 0) -> Certificate:
    """The self-signed certificate of an inbound: the same bytes for the same (secret, inbound, name, rotate)."""
    seed = int.from_bytes(secret.derive("tls-p256", inbound_id, str(rotate), length=48), "big")
    key = ec.derive_private_key(seed % (_P256_ORDER - 1) + 1, ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, server_name)])
    try:
        san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(server_name))
    except ValueError:
        san = x509.DNSName(server_name)
    serial = int.from_bytes(secret.derive("tls-serial", inbound_id, str(rotate), server_name, length=16), "big") >> 1
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(serial or 1).not_valid_before(NOT_BEFORE)
            .not_valid_after(NOT_BEFORE + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(key, hashes.SHA256(), ecdsa_deterministic=True))
    key_pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()).decode()
    return Certificate(cert.public_bytes(Encoding.PEM).decode(), key_pem)


def spki_pin(cert_pem: str) -> str:
    """base64 SHA-256 of a certificate's public key (what sing-box's certificate_public_key_sha256 takes)."""
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    spki = cert.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


def certificate_sha256(cert_pem: str) -> str:
    """Hex SHA-256 of a certificate's DER bytes: what Hysteria2 links' ``pinSHA256`` and Mihomo's ``fingerprint``
    take (a certificate fingerprint, not a key pin: it changes when the certificate is re-issued)."""
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    return hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()
