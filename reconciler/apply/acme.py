"""Certificates from an ACME CA for ``tls: {acme: true}`` inbounds: ordered and renewed by the controller.

Before an apply (the CLI's, and the loop's self-heal) every ACME inbound whose certificate is missing, or expires
within ``settings.acme.renew_before``, is ordered from ``settings.acme.directory`` (RFC 8555, with certbot's
``acme`` library): a fresh P-256 key and CSR for its ``server_name``; the HTTP-01 challenge answered on the server
itself (``reconciler.engine.scripts.acme``, detached, on ``settings.acme.http_port``, stopped once the CA has
validated); the chain and key kept in the state folder (``acme/``, mode 0600, never in git). The plan then writes
them to the server like any certificate, and the engine reloads them: no restart, no gap.

One inbound's failure is that inbound's (its server keeps the certificate it has: the last one, or until the first
arrives the one derived from the secret); the others go on. The loop waits longer after each failure (``CERTIFICATE_BACKOFF``).
The account key is made once and kept beside the certificates; a kept pair whose key is not the certificate's is
ordered again.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from reconciler.backoff import Backoff, Streaks
from reconciler.engine import remote
from reconciler.engine.adapters import acme_dir
from reconciler.engine.base import acme_paths
from reconciler.errors import RemoteError
from reconciler.model import Cluster, Server
from reconciler.model.cluster import ACMESettings
from reconciler.ssh import Runner, Target
from reconciler.ssh.runner import answer
from reconciler.state.files import write_atomic

log = logging.getLogger("reconciler.acme")

ACCOUNT = "account.key"
RUN = "/run/reconciler-acme.run"
OUT = "/run/reconciler-acme.out"
RESPONDER_SECONDS = 180
VALIDATION_SECONDS = 120


@dataclass(frozen=True)
class Wanted:
    server: Server
    inbound: str
    name: str  # the server name the certificate is for


def wanted(cluster: Cluster) -> list[Wanted]:
    found = []
    for s in cluster.servers:
        for ib in s.inbounds:
            tls = getattr(ib, "tls", None)
            if tls is not None and tls.acme:
                found.append(Wanted(s, ib.id, tls.server_name))
    return found


def not_after(cert_path: str) -> float | None:
    """When the certificate at ``cert_path`` expires (epoch seconds), or None when it is missing or unreadable."""
    try:
        with open(cert_path, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
    except (OSError, ValueError):
        return None
    return cert.not_valid_after_utc.timestamp()


def _pair_matches(cert_path: str, key_path: str) -> bool:
    """Whether the kept key is the certificate's (a crash between writing them leaves a pair that is not)."""
    try:
        with open(cert_path, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        with open(key_path, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), None)
    except (OSError, ValueError, TypeError):
        return False
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    return bool(cert.public_key().public_bytes(serialization.Encoding.DER, spki)
                == key.public_key().public_bytes(serialization.Encoding.DER, spki))


def due(cluster: Cluster, base_dir: str, now: float) -> list[Wanted]:
    """The ACME inbounds whose certificate is missing, not its key's, or expires within ``renew_before`` of ``now``."""
    folder = acme_dir(cluster, base_dir)
    limit = now + cluster.settings.acme.renew_before
    found = []
    for w in wanted(cluster):
        cert_path, key_path = acme_paths(folder, w.inbound)
        end = not_after(cert_path)
        if end is None or end <= limit or not _pair_matches(cert_path, key_path):
            found.append(w)
    return found


#: Failed orders per inbound: the loop asks the CA again only after a while (1 h, doubling to a day), as a CA
#: limits failed validations (Let's Encrypt: 5 an hour per name).
CERTIFICATE_BACKOFF = Backoff(first=3600.0, cap=86400.0)



async def ensure_certificates(cluster: Cluster, runner: Runner, base_dir: str, now: float | None = None,
                              say: Callable[[str], None] = log.info, backoff: Streaks[str] | None = None) -> dict[str, str]:
    """Order every certificate that is due (and, with ``backoff``, not failing lately); returns inbound → why it
    could not be had (empty: all good)."""
    now = time.time() if now is None else now
    todo = [w for w in due(cluster, base_dir, now) if backoff is None or backoff.ready(w.inbound, now)]
    if not todo:
        return {}
    folder = acme_dir(cluster, base_dir)
    settings = cluster.settings.acme
    try:
        client = await asyncio.to_thread(_client, settings, folder)
    except Exception as exc:  # noqa: BLE001 — the CA unreachable or refusing: every due inbound says why
        why = f"the ACME CA at {settings.directory} cannot be used: {type(exc).__name__}: {str(exc)[:300]}"
        for w in todo:
            if backoff is not None:
                backoff.failed(w.inbound, now)
        return {w.inbound: why for w in todo}
    errors: dict[str, str] = {}

    async def one(w: Wanted) -> None:
        say(f"{w.server.name}: ordering a certificate for {w.name} ({w.inbound}) from {settings.directory}")
        try:
            await _order(client, runner, Target.from_server(w.server), w, settings, folder)
            say(f"{w.server.name}: certificate for {w.name} issued")
            if backoff is not None:
                backoff.succeeded(w.inbound)
        except Exception as exc:  # noqa: BLE001 — this inbound's failure, not the others'
            errors[w.inbound] = f"{type(exc).__name__}: {str(exc)[:400]}"
            if backoff is not None:
                backoff.failed(w.inbound, now)
            log.warning("%s: no certificate for %s: %s", w.server.name, w.name, errors[w.inbound])

    by_server: dict[str, list[Wanted]] = {}
    for w in todo:
        by_server.setdefault(w.server.name, []).append(w)

    async def server(ws: list[Wanted]) -> None:  # one responder on a server's port at a time
        for w in ws:
            await one(w)

    await asyncio.gather(*(server(ws) for ws in by_server.values()))
    return errors


def _client(settings: ACMESettings, folder: str) -> Any:
    """An ACME client with our account (made once, its key kept in ``folder``)."""
    from acme import client, errors, messages
    from josepy.jwk import JWKRSA

    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, ACCOUNT)
    try:
        with open(path, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), None)
    except FileNotFoundError:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        write_atomic(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()), 0o600)
    assert isinstance(key, rsa.RSAPrivateKey)
    # verify_ssl goes to requests' `verify`, which also takes a CA bundle's path
    net = client.ClientNetwork(JWKRSA(key=key), user_agent="reconciler",
                               verify_ssl=settings.ca_bundle or True)  # type: ignore[arg-type]
    directory = client.ClientV2.get_directory(settings.directory, net)
    acme = client.ClientV2(directory, net)
    registration = messages.NewRegistration.from_data(email=settings.email, terms_of_service_agreed=True)
    try:
        net.account = acme.new_account(registration)
    except errors.ConflictError as exc:  # the account exists (this key registered before)
        net.account = acme.query_registration(messages.RegistrationResource(uri=exc.location, body=messages.Registration()))
    return acme


async def _order(acme: Any, runner: Runner, target: Target, w: Wanted, settings: ACMESettings, folder: str) -> None:
    from acme import challenges, crypto_util

    key = ec.generate_private_key(ec.SECP256R1())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    csr = crypto_util.make_csr(key_pem, [w.name])
    order = await asyncio.to_thread(acme.new_order, csr)
    started = False
    try:
        for authz in order.authorizations:
            if authz.body.status.name == "valid":
                continue  # the CA still trusts an earlier validation (a renewal soon after)
            challb = next((c for c in authz.body.challenges if isinstance(c.chall, challenges.HTTP01)), None)
            if challb is None:
                raise RuntimeError(f"the CA offers no HTTP-01 challenge for {w.name}")
            response, validation = challb.response_and_validation(acme.net.key)
            if not started:
                await _responder(runner, target, challb.chall.encode("token"), validation, settings.http_port)
                started = True
            await asyncio.to_thread(acme.answer_challenge, challb, response)
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=VALIDATION_SECONDS)
        order = await asyncio.to_thread(acme.poll_and_finalize, order, deadline)
    finally:
        if started:
            try:
                await runner.script(target, remote.FILES, {"op": "remove", "paths": [RUN]})
            except RemoteError:
                pass  # it stops by itself within RESPONDER_SECONDS
    if not order.fullchain_pem:
        raise RuntimeError(f"the CA finalized the order for {w.name} without a certificate")
    cert_path, key_path = acme_paths(folder, w.inbound)
    write_atomic(key_path, key_pem, 0o600)
    write_atomic(cert_path, order.fullchain_pem.encode(), 0o600)


async def _responder(runner: Runner, target: Target, token: str, validation: str, port: int) -> None:
    """Start the HTTP-01 answer on the server and wait until it listens (or says why it cannot)."""
    req = {"port": port, "token": token, "validation": validation, "run": RUN, "out": OUT, "seconds": RESPONDER_SECONDS}
    await runner.script(target, remote.FILES, {"op": "remove", "paths": [RUN, OUT]})
    await runner.script(target, remote.ACME, req, detach=True)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        res = await runner.script(target, remote.FILES, {"op": "read", "paths": [OUT], "limit": 4096})
        value = answer(res, target, remote.FILES, {"files": dict})["files"].get(OUT)
        if isinstance(value, str):
            import base64

            state = json.loads(base64.b64decode(value) or b"{}")
            if state.get("ready"):
                return
            if state.get("error"):
                raise RuntimeError(str(state["error"])[:300])
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the HTTP-01 responder on {target.name} did not start within 15 s")
