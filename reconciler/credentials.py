"""Credentials derived from the master secret (GITOPS-6). Pure: the secret is passed in.

Nothing secret is stored in the cluster file. Every user's UUID and passwords,
every subscription token, every Shadowsocks server key, every REALITY key pair
and the default REALITY short id come from HMAC-SHA256 over the master secret
with a purpose label, so the controller can recompute them at any time and two
clusters with different secrets share nothing.

Rotation:
- one user: bump ``users[].rotate`` (an integer, default 0) — that user's
  UUID, passwords and subscription token change on the next apply; the old
  subscription URL stops working;
- one REALITY inbound's key pair: bump its ``rotate`` — the servers get
  the new private key and every subscription the new public key on the next apply
  and render;
- everything: change the master secret — every credential and token changes.

REALITY key pairs are X25519 pairs derived here too, so whoever holds the
secret knows every REALITY inbound's public key: subscriptions carry REALITY entries
from the first render, with no apply and no facts file.

The master secret must be long (``MIN_SECRET_BYTES``) and not guessable: ``strength_bits``
estimates its entropy (character classes, repeats, runs and common words count for little) and
``Secret`` refuses one under ``MIN_SECRET_BITS``; ``reconciler secret new`` prints a good one.

What a person sees in place of a secret (GITOPS-6): ``fingerprint(value)``, a short prefix of an HMAC of
it under a key derived from the master secret (``use_fingerprint_key``), so a short or guessable value (a
REALITY short id, a chosen password) cannot be found again from a plan, a log or a saved plan by trying
candidates without the secret; ``Redactor`` replaces every known secret value and every PEM block in a text by its
fingerprint (the engine adapter records the values it put into each file: ``ManagedFile.secrets``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from reconciler.errors import SecretError
from reconciler.safe_read import read_regular_file

MIN_SECRET_BYTES = 16
MAX_SECRET_FILE_BYTES = 64 * 1024  # a secret is tens of bytes; a bigger file is the wrong file
#: The entropy floor: 16 random base64 characters estimate ~90 bits, `aaaaaaaaaaaaaaaa` 5, `passwordpassword` 12.
MIN_SECRET_BITS = 64
#: Common password words and keyboard rows: each counts as one guess, whatever its length.
COMMON_WORDS = ("password", "passwort", "secret", "qwertyuiop", "asdfghjkl", "zxcvbnm", "letmein", "changeme",
                "admin", "welcome", "master", "default", "reconciler", "iloveyou", "dragon", "monkey", "shadow",
                "football", "baseball", "sunshine", "trustno1", "azerty", "qwertz")


def _pool(value: bytes) -> int:
    """How many symbols each character was drawn from, judging by the classes present."""
    pool = 0
    for present, size in ((any(97 <= b <= 122 for b in value), 26), (any(65 <= b <= 90 for b in value), 26),
                          (any(48 <= b <= 57 for b in value), 10),
                          (any(32 < b < 127 and not chr(b).isalnum() for b in value), 33),
                          (any(b >= 127 or b <= 32 for b in value), 161)):
        pool += size if present else 0
    return max(pool, 2)


def strength_bits(value: bytes, enough: float = float("inf")) -> float:
    """An entropy estimate of a secret: log2(pool) bits per *token*, where a token is one character, a run
    (``aaaa``, ``1234``, ``fedc``), a repeat of something earlier, or a common word. Stops counting at ``enough``.

    Cheap by construction: every token adds at least log2(10) bits, so a string reaches any floor in a
    few dozen tokens; only the first 1024 bytes are looked at."""
    text = value[:1024]
    lower = text.lower()
    per_token = math.log2(_pool(value))
    bits, i = 0.0, 0
    while i < len(text) and bits < enough:
        step = 1
        word = next((w for w in COMMON_WORDS if lower.startswith(w.encode(), i)), None)
        if word is not None:
            step = len(word)
        elif i + 2 < len(text) and text[i + 1] - text[i] == text[i + 2] - text[i + 1] and abs(text[i + 1] - text[i]) <= 1:
            delta, step = text[i + 1] - text[i], 2
            while i + step < len(text) and text[i + step] - text[i + step - 1] == delta:
                step += 1
        else:
            for j in range(i):  # the longest earlier match (it may overlap, as in LZ77)
                n = 0
                while i + n < len(text) and text[j + n] == text[i + n]:
                    n += 1
                step = max(step, n if n >= 3 else 1)
        bits += per_token
        i += step
    return bits


@dataclass(frozen=True)
class Secret:
    """The master secret: at least ``MIN_SECRET_BYTES`` long and ``MIN_SECRET_BITS`` strong. ``repr`` never shows it."""

    value: bytes

    def __post_init__(self) -> None:
        if len(self.value) < MIN_SECRET_BYTES:
            raise SecretError(f"the master secret must be at least {MIN_SECRET_BYTES} bytes")
        if strength_bits(self.value, MIN_SECRET_BITS) < MIN_SECRET_BITS:
            raise SecretError(f"the master secret is too easy to guess (repeats, runs, common words or a single kind "
                              f"of character: under {MIN_SECRET_BITS} bits by our estimate); "
                              "make a random one with `reconciler secret new`")

    def __repr__(self) -> str:
        return "Secret(<redacted>)"

    def derive(self, purpose: str, *parts: str, length: int = 32) -> bytes:
        if length <= 0:
            raise ValueError(f"a derived value is at least one byte long, not {length}")
        msg = "\x1f".join((purpose, *parts)).encode()
        if length <= 32:
            return _hmac(self.value, msg + b"\0")[:length]
        out = b""
        counter = 0
        while len(out) < length:
            out += _hmac(self.value, msg + bytes([counter]))
            counter += 1
        return out[:length]


@lru_cache(maxsize=4)
def _pads(key: bytes) -> tuple[hashlib._Hash, hashlib._Hash]:
    """HMAC-SHA256's inner and outer hashes of ``key`` with its pads absorbed (RFC 2104): copied for each message."""
    if len(key) > 64:
        key = hashlib.sha256(key).digest()
    key = key.ljust(64, b"\0")
    return hashlib.sha256(bytes(b ^ 0x36 for b in key)), hashlib.sha256(bytes(b ^ 0x5C for b in key))


def _mac(inner: hashlib._Hash, outer: hashlib._Hash, msg: bytes) -> bytes:
    """HMAC-SHA256 of ``msg`` from a key's padded hashes (``_pads``)."""
    i = inner.copy()
    i.update(msg)
    o = outer.copy()
    o.update(i.digest())
    return o.digest()


def _hmac(key: bytes, msg: bytes) -> bytes:
    """HMAC-SHA256 of ``msg`` under ``key``: the same bytes as ``hmac.digest``, from the key's padded hashes kept
    (``_pads``) rather than set up again for each message (0.5 µs against 1.3)."""
    inner, outer = _pads(key)
    return _mac(inner, outer, msg)


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
            f"no master secret in {where}; create one with `reconciler secret new` (or `openssl rand -base64 32`) "
            "and keep it out of git"
        )
    try:
        secret = Secret(raw)
    except SecretError as exc:
        raise SecretError(f"{exc} ({where})") from None
    use_fingerprint_key(secret)
    return secret


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
    (uuid, password, ss_128, ss_256), token = credential_bytes(secret, user, rotate, shadowsocks=shadowsocks)
    return UserCredentials(uuid=uuid.decode(), password=password.decode(), ss_key_128=ss_128.decode(),
                           ss_key_256=ss_256.decode(), token=token.decode())




def credential_bytes(secret: Secret, user: str, rotate: int = 0, wanted: tuple[bool, bool, bool, bool] = (True,) * 4,
                     shadowsocks: bool = True) -> tuple[tuple[bytes, bytes, bytes, bytes], bytes]:
    """A user's credentials as ASCII bytes, ``((uuid, password, ss_key_128, ss_key_256), token)``: what
    ``user_credentials`` holds, and what a document is filled with (``subscriptions.document.Prepared``). ``wanted``:
    which of the four are derived (the others are empty: a pass whose documents hold only UUIDs derives two HMACs
    a user, not four); the token always is.

    Each is ``secret.derive(purpose, user, str(rotate))``, one HMAC block, spelt out (~2 µs a user for a token and
    a UUID, not 11). The purposes: ``token``, ``uuid``, ``password``, ``ss2022-user``."""
    tail = f"\x1f{user}\x1f{rotate}\0".encode()
    inner, outer = _pads(secret.value)
    token = _mac(inner, outer, b"token" + tail)
    uuid = password = ss = b""
    if wanted[0]:
        raw = bytearray(_mac(inner, outer, b"uuid" + tail)[:16])
        raw[6] = raw[6] & 0x0F | 0x40  # version 4 and the RFC 4122 variant, as uuid.UUID(version=4) sets them
        raw[8] = raw[8] & 0x3F | 0x80
        h = raw.hex()
        uuid = f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}".encode()
    if wanted[1]:
        password = _mac(inner, outer, b"password" + tail)
    if shadowsocks and (wanted[2] or wanted[3]):
        ss = _mac(inner, outer, b"ss2022-user" + tail)
    # The 128-bit key is the first half of the 256-bit one (the same first HMAC block): derived once.
    return ((uuid, base64.urlsafe_b64encode(password[:18]) if password else b"",  # 18 and 24 bytes: no padding
             base64.b64encode(ss[:16]) if ss else b"", base64.b64encode(ss) if ss else b""),
            base64.urlsafe_b64encode(token[:24]))


PROBE_USER = "~probe"  # never a user's name (``~`` is not allowed in one): the witnesses' credential on every inbound


def probe_credentials(secret: Secret) -> UserCredentials:
    """The witnesses' probe credential (HEALTH-16): on every inbound of every server, in no subscription, routed by
    the servers to the probe responder only, and never counted as anyone's traffic."""
    return user_credentials(secret, PROBE_USER)


TOKEN_CHARS = 32  # 24 bytes of HMAC, base64url without padding
_TOKEN = re.compile(rf"[A-Za-z0-9_-]{{{TOKEN_CHARS}}}")


def is_token(text: str) -> bool:
    """Whether ``text`` has the form of a subscription token (checked before a token names a path or a user)."""
    return _TOKEN.fullmatch(text) is not None


def user_token(secret: Secret, user: str, rotate: int = 0) -> str:
    """The user's subscription URL token (192 bits) alone: what a token → user index needs (a million at a time:
    ``derive`` at 1.1 µs, where ``credential_bytes`` wanting nothing else took 1.7; the tests hold both to the
    definition)."""
    return _b64(secret.derive("token", user, str(rotate), length=24))


def ss_server_key(secret: Secret, inbound_id: str, method: str) -> str:
    """The Shadowsocks-2022 server PSK of one inbound (base64, the method's key length)."""
    return base64.b64encode(secret.derive("ss2022-server", inbound_id, length=16 if "128" in method else 32)).decode()


def reality_short_id(secret: Secret, inbound_id: str, rotate: int = 0) -> str:
    """The default REALITY short id of an inbound (8 hex characters); ``rotate`` gives a new one with the new
    key pair (0 keeps the id inbounds had before rotation existed)."""
    parts = (inbound_id,) if not rotate else (inbound_id, str(rotate))
    return secret.derive("reality-sid", *parts, length=4).hex()


@dataclass(frozen=True)
class RealityKeys:
    """A REALITY X25519 key pair as sing-box, Xray and Mihomo write it: 32 raw bytes each, base64url without
    padding (43 characters; what ``sing-box generate reality-keypair`` prints). ``repr`` hides the private key."""

    private_key: str = field(repr=False)  # the server's configuration only
    public_key: str  # every client's ``pbk`` / ``public_key``


@lru_cache(maxsize=4096)  # 23 µs a pair; the loop asks for every REALITY inbound's public key at every interval
def reality_keys(secret: Secret, inbound_id: str, rotate: int = 0) -> RealityKeys:
    """The REALITY key pair of an inbound, derived from the master secret: stable for (secret, inbound, rotate),
    different for any other. The private scalar is stored clamped (RFC 7748), as Xray's ``x25519`` writes it;
    X25519 clamps anyway, so the public key is the same either way."""
    raw = bytearray(secret.derive("reality-x25519", inbound_id, str(rotate), length=32))
    raw[0] &= 248
    raw[31] = (raw[31] & 127) | 64
    public = X25519PrivateKey.from_private_bytes(bytes(raw)).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return RealityKeys(private_key=_b64(bytes(raw)), public_key=_b64(public))


def clash_api_secret(secret: Secret, server: str) -> str:
    """The bearer secret of a server's loopback clash_api (stats)."""
    return _b64(secret.derive("clash-api", server, length=18))


DEVICE_KEY_PERIOD = 86_400  # seconds: the device fingerprints' key changes every UTC day


def device_fingerprint_key(secret: Secret, day: int) -> str:
    """The key the agents fingerprint client addresses with on ``day`` (``now // DEVICE_KEY_PERIOD``): an address
    is never stored, and what is stored (state, etcd, a server's answer) gives no address back without the master
    secret; a new key every day, so fingerprints of different days cannot be linked."""
    return secret.derive("device-fingerprint", str(day), length=16).hex()


# --------------------------------------------------------------------------- what a person sees instead

FINGERPRINT_HEX = 12
PEM_BLOCK = re.compile(r"-----BEGIN ([A-Z0-9 ]{0,60})-----.*?(?:-----END \1-----|\Z)", re.S)
PEM_MARKER = re.compile(r"-----(BEGIN|END)[A-Z0-9 ]{0,60}-----")
# Credential values under these JSON keys, known or not (old contents read back from a server).
_CREDENTIAL_KEYS = re.compile(r'("(?:uuid|password|secret|private_key|short_id|key|psk|token)"\s*:\s*)("[^"]*"|\[[^\]]*\])')
_JSON_STRING = re.compile(r'"([^"\\]*)"')


FINGERPRINT_PREFIX = "fp:"
_fingerprint_key: list[bytes] = [os.urandom(32)]  # until a master secret is loaded: this process's own, random


def use_fingerprint_key(secret: Secret) -> None:
    """Key every fingerprint this process shows with ``secret`` (done when the master secret is loaded): the same
    value shows the same fingerprint in a plan and in the apply that checks it, and only the secret's holder can
    test a guess against one."""
    _fingerprint_key[0] = secret.derive("display-fingerprint")


def fingerprint(value: str | bytes) -> str:
    """``fp:<12 hex>…``: what a person sees in place of a secret value or an opaque file (keyed: GITOPS-6)."""
    return fingerprint_digest(hashlib.sha256(value.encode() if isinstance(value, str) else value).hexdigest())


def fingerprint_digest(sha256_hex: str) -> str:
    """The fingerprint of content whose sha256 is known (a file on a server, by its facts): keyed too, since the
    sha256 of a short file is as guessable as the file."""
    mac = hmac.digest(_fingerprint_key[0], sha256_hex.encode(), "sha256").hex()
    return f"{FINGERPRINT_PREFIX}{mac[:FINGERPRINT_HEX]}…"


@dataclass(frozen=True)
class Redactor:
    """Replaces secrets in a text meant for a person by their fingerprints: every PEM block, every value in
    ``values`` (the exact secrets put into a file) and, with ``structural``, every string under a credential
    key of JSON text (``"password": "…"``), known or not. Cost: one pass per known value, for the short texts
    shown to people (diffs are bounded, messages short)."""

    values: frozenset[str] = field(default=frozenset(), repr=False)

    @classmethod
    def of(cls, values: Iterable[str]) -> Redactor:
        return cls(frozenset(v for v in values if len(v) >= 4))

    def __add__(self, other: Redactor) -> Redactor:
        return Redactor(self.values | other.values)

    def __call__(self, text: str, structural: bool = False) -> str:
        text = PEM_BLOCK.sub(lambda m: f"<PEM {m.group(1).lower() or 'block'} {fingerprint(m.group(0))}>", text)
        text = PEM_MARKER.sub("<PEM marker>", text)  # an END whose BEGIN was cut off
        if structural:
            text = _CREDENTIAL_KEYS.sub(lambda m: m.group(1) + _JSON_STRING.sub(
                lambda s: f'"{fingerprint(s.group(1))}"' if s.group(1) else '""', m.group(2)), text)
        for v in sorted(self.values, key=len, reverse=True):
            if v in text:
                text = text.replace(v, fingerprint(v))
        return text
