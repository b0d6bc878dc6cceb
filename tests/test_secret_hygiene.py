"""The master secret's floor and ``reconciler secret new`` (GITOPS-6, issue 13): long is not enough, it must be
hard to guess; the command prints a good one and says where to keep it, writing nothing."""

from __future__ import annotations

import base64
import secrets

import pytest

from reconciler.credentials import MIN_SECRET_BITS, Secret, load_secret, strength_bits
from reconciler.errors import SecretError


@pytest.mark.parametrize("value", [
    "aaaaaaaaaaaaaaaa", "passwordpassword", "0123456789abcdef", "abcdefghijklmnopqrstuvwxyz", "abababababababababab",
    "Password12345678", "qwertyuiopasdfgh", "mysecretpassword123", "secretsecretsecret", "zyxwvutsrqponmlkjih",
    "changeme-changeme", "1111111111111111111111111111",
])
def test_repetitive_or_dictionary_like_secrets_are_refused(value, monkeypatch):
    assert strength_bits(value.encode()) < MIN_SECRET_BITS
    monkeypatch.setenv("RECONCILER_SECRET", value)
    with pytest.raises(SecretError, match="too easy to guess.*reconciler secret new.*environment variable RECONCILER_SECRET"):
        load_secret()


def test_random_secrets_of_16_characters_and_more_pass():
    for _ in range(2000):
        Secret(base64.b64encode(secrets.token_bytes(12)))  # 16 characters of base64
        Secret(secrets.token_urlsafe(12).encode())
        Secret(secrets.token_hex(16).encode())  # `openssl rand -hex 16`
        Secret(secrets.token_bytes(16))  # a binary secret file
    assert Secret(b"from-a-file-0123456789abcdef")  # words and a run, but enough else


def test_the_estimate_is_cheap_on_a_large_file():
    import time

    start = time.perf_counter()
    for text in (b"ab" * 32768, secrets.token_bytes(65536), b"abcabd" * 10000):
        strength_bits(text, MIN_SECRET_BITS)
    assert time.perf_counter() - start < 1.0


def test_secret_new_prints_a_strong_secret_and_where_to_keep_it(cli, tmp_path):
    before = set(tmp_path.iterdir())
    run = cli("secret", "new", "-f", str(tmp_path / "absent.yaml"))
    assert run.rc == 0, run.text
    value = run.out.strip()
    assert run.out == value + "\n" and len(value) >= 43 and strength_bits(value.encode()) >= MIN_SECRET_BITS
    assert "RECONCILER_SECRET" in run.err and "never in the repository" in run.err and "chmod 600" in run.err
    assert value not in run.err and set(tmp_path.iterdir()) == before  # printed once, written nowhere
    assert cli("secret", "new").out.strip() != value
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("settings: {secret: {file: /etc/reconciler/secret}}\nservers: []\n")
    run = cli("secret", "new", "-f", str(cluster))
    assert "umask 077; reconciler secret new > /etc/reconciler/secret" in run.err, run.err
