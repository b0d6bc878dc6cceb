"""Public key material for the snapshot, derived on the controller. Pure.

Whoever holds the master secret knows every REALITY inbound's public key (``reconciler.credentials.reality_keys``)
and every self-signed certificate's pins (``reconciler.certificates.derived_certificate``): the CLI's
``fleet_snapshot`` and the loop merge them over the facts on record, so subscriptions carry REALITY and pinned
TLS entries from the first render, with no apply and no facts file. A derived value wins over a remembered one
(a key or certificate that a server generated itself, in older versions, is replaced at its next apply).
"""

from __future__ import annotations

from collections.abc import Mapping

from reconciler.certificates import derived_certificate
from reconciler.credentials import Secret, reality_keys
from reconciler.model import Cluster
from reconciler.subscriptions.outbound import pin_record, self_signed


def reality_public_keys(cluster: Cluster, secret: Secret) -> dict[str, str]:
    """Inbound id → the public key of every REALITY inbound in ``cluster`` (base64url, as clients write it)."""
    return {ib.id: reality_keys(secret, ib.id, ib.rotate).public_key
            for s in cluster.servers for ib in s.inbounds if ib.protocol == "vless-reality"}


def tls_pins(cluster: Cluster, secret: Secret) -> dict[str, str]:
    """Inbound id → the pins (``pin_record``) of every TLS inbound whose certificate is derived from the secret."""
    pins = {}
    for s in cluster.servers:
        for ib in s.inbounds:
            tls = getattr(ib, "tls", None)
            if tls is not None and self_signed(tls):
                cert = derived_certificate(secret, ib.id, tls.server_name, tls.rotate)
                pins[ib.id] = pin_record(cert.spki_pin, cert.sha256)
    return pins


def with_reality_keys(facts: Mapping[str, Mapping[str, str]], cluster: Cluster,
                      secret: Secret) -> dict[str, Mapping[str, str]]:
    """``facts`` (as the state folder keeps them) with the derived public keys and pins merged over its own."""
    return {**facts, "public_keys": {**facts.get("public_keys", {}), **reality_public_keys(cluster, secret)},
            "tls_pins": {**facts.get("tls_pins", {}), **tls_pins(cluster, secret)}}
