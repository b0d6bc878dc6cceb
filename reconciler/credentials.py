"""Credentials derived from the master secret (GITOPS-6). Pure: the secret is passed in.

Nothing secret is stored in the cluster file. Every user's UUID and passwords,
every subscription token, every Shadowsocks server key and the default REALITY
short id come from HMAC-SHA256 over the master secret with a purpose label, so
the controller can recompute them at any time and two clusters with different
secrets share nothing.

Rotation:
- one user: bump ``users[].rotate`` (an integer, default 0) — that user's
  UUID, passwords and subscription token change on the next apply; the old
  subscription URL stops working;
- everything: change the master secret — every credential and token changes;
- engine keys (REALITY private keys) are generated on the servers and never
  leave them; rotate them by deleting the key file on the server.
"""

from __future__ import annotations

import base64
import hmac
import os
import re
import uuid
from dataclasses import dataclass

from reconciler.errors import SecretError
from reconciler.safe_read import read_regular_file

MIN_SECRET_BYTES = 16
MAX_SECRET_FILE_BYTES = 64 * 1024  # a secret is tens of bytes; a bigger file is the wrong file




@dataclass(frozen=True)
class Secret:
    """The master secret. ``repr`` never shows it."""

    value: bytes

    def __post_init__(self) -> None:
        if len(self.value) < MIN_SECRET_BYTES:
            raise SecretError(f"the master secret must be at least {MIN_SECRET_BYTES} bytes")

    def __repr__(self) -> str:
        return "Secret(<redacted>)"

    def derive(self, purpose: str, *parts: str, length: int = 32) -> bytes:
        msg = "\x1f".join((purpose, *parts)).encode()
        out = b""
        counter = 0
        while len(out) < length:
            out += hmac.digest(self.value, msg + bytes([counter]), "sha256")  # one-shot C HMAC: same bytes, 3x faster
            counter += 1
        return out[:length]


def read_credential(env: str, file: str | None, what: str) -> tuple[bytes, str]:
    """(value, where it came from) of a secret held in a file (when given) or an environment variable.

    One normalisation for both sources (surrounding white space, a trailing newline, is not part of
    it), and a file must be readable by its owner only (0600 or 0400), as ssh asks of its keys.
    """
    if file:
        path = os.path.expanduser(file)
        try:
            mode = os.stat(path).st_mode & 0o777
            raw = read_regular_file(path, MAX_SECRET_FILE_BYTES)
        except OSError as exc:
            raise SecretError(f"cannot read the {what} from {path}: {exc.strerror}") from None
        if mode & 0o077:
            raise SecretError(f"{path} holds the {what} but is mode {mode:04o}: others may read it; "
                              f"run `chmod 600 {path}`")
        where = f"file {path}"
    else:
        raw = os.environ.get(env, "").encode()
        where = f"environment variable {env}"
    return raw.strip(), where


def load_secret(env: str = "RECONCILER_SECRET", file: str | None = None) -> Secret:
    """Read the master secret from a file (when given) or an environment variable."""
    raw, where = read_credential(env, file, "master secret")
    if not raw:
        raise SecretError(
            f"no master secret in {where}; create one with `openssl rand -base64 32` and keep it out of git"
        )
    try:
        return Secret(raw)
    except SecretError as exc:
        raise SecretError(f"{exc} ({where})") from None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass(frozen=True)
class UserCredentials:
    uuid: str  # VLESS and TUIC
    password: str  # Trojan, Hysteria2, TUIC
    ss_key_128: str  # Shadowsocks-2022 user key (base64), aes-128
    ss_key_256: str  # aes-256 and chacha20
    token: str  # subscription URL token, 192 bits

    def ss_key(self, method: str) -> str:
        return self.ss_key_128 if "128" in method else self.ss_key_256


def user_credentials(secret: Secret, user: str, rotate: int = 0, shadowsocks: bool = True) -> UserCredentials:
    """Every credential of a user. ``shadowsocks=False`` leaves the SS-2022 keys empty (a cluster without
    Shadowsocks inbounds; one HMAC fewer per user when writing 100k subscriptions)."""
    gen = str(rotate)
    raw = bytearray(secret.derive("uuid", user, gen, length=16))
    # The 128-bit key is the first half of the 256-bit one (the same first HMAC block): derived once.
    ss = secret.derive("ss2022-user", user, gen, length=32) if shadowsocks else b""
    return UserCredentials(
        uuid=str(uuid.UUID(bytes=bytes(raw), version=4)),
        password=_b64(secret.derive("password", user, gen, length=18)),
        ss_key_128=base64.b64encode(ss[:16]).decode() if ss else "",
        ss_key_256=base64.b64encode(ss).decode() if ss else "",
        token=user_token(secret, user, rotate),
    )


TOKEN_CHARS = 32  # 24 bytes of HMAC, base64url without padding
_TOKEN = re.compile(rf"[A-Za-z0-9_-]{{{TOKEN_CHARS}}}")


def is_token(text: str) -> bool:
    """Whether ``text`` has the form of a subscription token (checked before a token names a path or a user)."""
    return _TOKEN.fullmatch(text) is not None


def user_token(secret: Secret, user: str, rotate: int = 0) -> str:
    """The user's subscription URL token (192 bits) alone: what a token → user index needs."""
    return _b64(secret.derive("token", user, str(rotate), length=24))


def ss_server_key(secret: Secret, inbound_id: str, method: str) -> str:
    """The Shadowsocks-2022 server PSK of one inbound (base64, the method's key length)."""
    return base64.b64encode(secret.derive("ss2022-server", inbound_id, length=16 if "128" in method else 32)).decode()


def reality_short_id(secret: Secret, inbound_id: str) -> str:
    """The default REALITY short id of an inbound (8 hex characters)."""
    return secret.derive("reality-sid", inbound_id, length=4).hex()


def clash_api_secret(secret: Secret, server: str) -> str:
    """The bearer secret of a server's loopback clash_api (stats)."""
    return _b64(secret.derive("clash-api", server, length=18))
