"""REALITY public keys for the snapshot, derived on the controller (issue 14). Pure.

Whoever holds the master secret knows every REALITY inbound's public key
(``reconciler.credentials.reality_keys``): the CLI's ``fleet_snapshot`` and the loop merge
them over the facts on record, so subscriptions carry REALITY entries from the first render,
with no apply and no facts file. A derived key wins over a remembered one: a key remembered
from a server that generated its own pair (before issue 14) is replaced at its next apply.
"""

from __future__ import annotations

from collections.abc import Mapping

from reconciler.credentials import Secret, reality_keys
from reconciler.model import Cluster


def reality_public_keys(cluster: Cluster, secret: Secret) -> dict[str, str]:
    """Inbound id → the public key of every REALITY inbound in ``cluster`` (base64url, as clients write it)."""
    return {ib.id: reality_keys(secret, ib.id, ib.rotate).public_key
            for s in cluster.servers for ib in s.inbounds if ib.protocol == "vless-reality"}


def with_reality_keys(facts: Mapping[str, Mapping[str, str]], cluster: Cluster,
                      secret: Secret) -> dict[str, Mapping[str, str]]:
    """``facts`` (as the state folder keeps them) with the derived public keys merged over its ``public_keys``."""
    return {**facts, "public_keys": {**facts.get("public_keys", {}), **reality_public_keys(cluster, secret)}}
