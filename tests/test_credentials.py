"""The derivations spelt out for speed give the very bytes of their definition: an HMAC-SHA256 per purpose over the
master secret (GITOPS-6), as the standard library computes it. A change here would give every user a new UUID,
password and subscription URL."""

from __future__ import annotations

import base64
import hmac
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.credentials import Secret, credential_bytes, user_credentials, user_token


def reference(key: bytes, purpose: str, user: str, rotate: int, length: int) -> bytes:
    msg = "\x1f".join((purpose, user, str(rotate))).encode()
    out, counter = b"", 0
    while len(out) < length:
        out += hmac.digest(key, msg + bytes([counter]), "sha256")
        counter += 1
    return out[:length]


# A strong start (Secret refuses weak ones), then anything: past 64 bytes HMAC hashes the key first.
secrets = st.binary(max_size=150).map(lambda b: b"k3Zq9vT2pLx8Wm4R" + b)
names = st.text(min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(secrets, names, st.integers(0, 10**6), st.booleans())
def test_user_credentials_are_the_hmacs_of_their_definition(key, user, rotate, shadowsocks):
    # spec: GITOPS-6
    secret = Secret(key)
    got = user_credentials(secret, user, rotate, shadowsocks)
    assert got.uuid == str(uuid.UUID(bytes=reference(key, "uuid", user, rotate, 16), version=4))
    assert got.password == base64.urlsafe_b64encode(reference(key, "password", user, rotate, 18)).rstrip(b"=").decode()
    assert got.token == user_token(secret, user, rotate)
    assert got.token == base64.urlsafe_b64encode(reference(key, "token", user, rotate, 24)).rstrip(b"=").decode()
    ss = reference(key, "ss2022-user", user, rotate, 32)
    assert (got.ss_key_128, got.ss_key_256) == ((base64.b64encode(ss[:16]).decode(), base64.b64encode(ss).decode())
                                                if shadowsocks else ("", ""))


@settings(max_examples=200, deadline=None)
@given(secrets, st.text(max_size=20), st.lists(st.text(max_size=10), max_size=3), st.integers(1, 100))
def test_derive_is_the_counter_mode_hmac_at_every_length(key, purpose, parts, length):
    msg = "\x1f".join((purpose, *parts)).encode()
    want = b"".join(hmac.digest(key, msg + bytes([c]), "sha256") for c in range(4))[:length]
    assert Secret(key).derive(purpose, *parts, length=length) == want


def test_derive_refuses_a_length_of_nothing():
    import pytest

    for length in (0, -1):  # (a slice of the HMAC by a negative length was 31 bytes for -1)
        with pytest.raises(ValueError, match="at least one byte"):
            Secret(b"k3Zq9vT2pLx8Wm4R-credential-bytes").derive("x", length=length)


@settings(max_examples=200, deadline=None)
@given(names, st.integers(0, 1000), st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()), st.booleans())
def test_only_the_credentials_wanted_are_derived_and_they_are_the_same(user, rotate, wanted, shadowsocks):
    secret = Secret(b"k3Zq9vT2pLx8Wm4R-credential-bytes")
    whole = user_credentials(secret, user, rotate, shadowsocks)
    values, token = credential_bytes(secret, user, rotate, wanted, shadowsocks)
    assert token.decode() == whole.token
    full = (whole.uuid, whole.password, whole.ss_key_128, whole.ss_key_256)
    ss_wanted = wanted[2] or wanted[3]
    for k, (got, want) in enumerate(zip(values, full, strict=True)):
        if wanted[k] or (k >= 2 and ss_wanted):  # the two Shadowsocks keys come from one HMAC
            assert got.decode() == want
        else:
            assert got == b""
