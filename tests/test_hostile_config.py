"""The cluster file and everything it names, as hostile input (issue 13, GITOPS-2).

A table of cluster files a red-team pass found to crash, hang, echo other files or
slip through, and the diagnostic each must give now. Every case asserts: exit code
1 from ``reconciler validate``, no traceback or "internal error", a diagnostic at
the right ``file:line:col``, and bounded time — each case runs in a thread that must
finish within ``LIMIT`` seconds, so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import base64
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest

from reconciler.config.yamlread import MAX_FILE_BYTES, MAX_TOTAL_BYTES
from reconciler.safe_read import read_regular_file
from tests.conftest import capable_example_text, example_text, plant

LIMIT = 30.0  # seconds; the worst case takes about 2 s on one core
LOCATION = re.compile(r"^(?P<file>[^\n]+?):(?P<line>\d+):(?P<col>\d+): error: (?P<msg>.*)$", re.M)

ED25519 = "AAAAC3NzaC1lZDI1NTE5AAAAIDYtcy6cneyL++IAPx7JODT/QzUS/j4X+u6/dvN5KXUP"
ED25519_CUT = base64.b64encode(base64.b64decode(ED25519)[:-5]).decode()

INTERVAL = "    report_interval: 60s"
HOST = "    host: 203.0.113.12"
SSH = "    ssh: {user: root, port: 22}"
PORT = "        port: 8388\n"
LISTEN = "    listen: 127.0.0.1:8080"
EXPIRES = "    expires: 2027-06-30"
LIMIT_LINE = "    data_limit: 200GB"
COEF = "    coefficient: 2.0 "


def _ssh(extra: str) -> tuple[str, str]:
    return SSH, "    ssh: {user: root, port: 22, " + extra + "}"


# (id, text planted, replacement, what the error must say, line of the error relative to the planted line)
PLANTED: list[tuple[str, str, str, str, int]] = [
    # Durations: finite, positive, not absurd.
    ("duration-nan", INTERVAL, "    report_interval: .nan", "report_interval: nan is not a finite duration", 0),
    ("duration-inf", INTERVAL, "    report_interval: .inf", "report_interval: inf is not a finite duration", 0),
    ("duration-neg-inf", INTERVAL, "    report_interval: -.inf", "is not a finite duration", 0),
    ("duration-NaN-caps", INTERVAL, "    report_interval: .NaN", "is not a finite duration", 0),
    ("duration-huge", INTERVAL, "    report_interval: 1e300", "a duration must be at most", 0),
    ("duration-huge-text", INTERVAL, "    report_interval: 99999999999999d", "a duration must be at most", 0),
    ("duration-long-text", INTERVAL, "    report_interval: " + "9" * 5000 + "s", "is not a duration", 0),
    ("float-nan", COEF, "    coefficient: .nan ", "coefficient: nan is not a finite number", 0),
    ("float-inf", "    stickiness: 0.2", "    stickiness: .inf", "stickiness: inf is not a finite number", 0),
    # Dates that do not exist.
    ("date-month-13", EXPIRES, "    expires: 2026-13-01", "expires: '2026-13-01' is not a valid date", 0),
    ("date-feb-30", EXPIRES, "    expires: 2026-02-30", "is not a valid date", 0),
    ("datetime-hour-25", EXPIRES, "    expires: 2026-01-01T25:00:00Z", "is not a valid date", 0),
    ("date-quoted", EXPIRES, '    expires: "2026-13-01"', "is not a date", 0),
    ("date-tagged-junk", EXPIRES, "    expires: !!timestamp soon", "'soon' is not a date", 0),
    ("date-year-zero", EXPIRES, "    expires: 0000-01-01", "is not a valid date", 0),
    # Tags: only the YAML core types, and only values their tag can hold.
    ("tag-int-junk", PORT, "        port: !!int abc\n", "port: 'abc' is not a whole number", 0),
    ("tag-int-empty-hex", PORT, "        port: !!int 0x\n", "is not a whole number", 0),
    ("tag-float-junk", COEF, "    coefficient: !!float x ", "coefficient: 'x' is not a number", 0),
    ("tag-bool-junk", "  self_heal: true", "  self_heal: !!bool maybe", "is not true or false", 0),
    ("tag-null-junk", HOST, "    host: !!null x", "!!null holds nothing", 0),
    ("tag-binary", HOST, "    host: !!binary aGVsbG8=", "the YAML tag !!binary is not accepted", 0),
    ("tag-python-object", HOST, "    host: !!python/object/apply:os.system [id]", "!!python/object/apply:os.system is not", 0),
    ("tag-python-name", HOST, "    host: !!python/name:os.system", "!!python/name:os.system is not accepted", 0),
    ("tag-python-tuple", HOST, "    host: !<tag:yaml.org,2002:python/tuple> [a]", "!!python/tuple is not accepted", 0),
    ("tag-set", HOST, "    host: !!set {a, b}", "!!set is not accepted", 0),
    ("tag-omap", HOST, "    host: !!omap [a: 1]", "!!omap is not accepted", 0),
    ("tag-pairs", HOST, "    host: !!pairs [a: 1]", "!!pairs is not accepted", 0),
    ("tag-custom", HOST, "    host: !vault secret", "!vault is not accepted", 0),
    ("tag-str-on-map", HOST, "    host: !!str {a: 1}", "!!str is not accepted", 0),
    ("tag-map-on-list", "    inbounds:\n      - id: fra-2-reality", "    inbounds: !!map\n      - id: fra-2-reality",
     "!!map is not accepted", 0),
    ("merge-scalar", HOST, "    <<: 5\n" + HOST, "`<<` merges a mapping", 0),
    ("huge-int", PORT, "        port: " + "9" * 5000 + "\n", "is not a usable whole number", 0),
    ("huge-int-in-range-field", PORT, "        port: " + "9" * 400 + "\n", "is out of range", 0),
    # Host keys: one OpenSSH public key line.
    ("host-key-text", *_ssh('host_key: "not a key"'), "host_key: 'not' is not an SSH public key type", 0),
    ("host-key-not-base64", *_ssh('host_key: "ssh-ed25519 !!!!"'), "is not valid base64", 0),
    ("host-key-other-blob", *_ssh('host_key: "ssh-ed25519 aGVsbG8gd29ybGQ="'), "is not an ssh-ed25519 key", 0),
    ("host-key-type-mismatch", *_ssh(f'host_key: "ecdsa-sha2-nistp256 {ED25519}"'), "is not an ecdsa-sha2-nistp256 key", 0),
    ("host-key-truncated", *_ssh(f'host_key: "ssh-ed25519 {ED25519_CUT}"'), "is not a usable SSH public key", 0),
    # Hosts and addresses by their RFC rules.
    ("host-300k", HOST, "    host: " + "a" * 300_000, "host: is too long (at most 253 characters)", 0),
    ("host-label-64", HOST, "    host: " + "a" * 64 + ".example.com", "is not a host name", 0),
    ("host-254", HOST, "    host: " + ".".join(["a" * 50] * 5) + ".com", "is too long", 0),
    ("host-leading-dash", HOST, "    host: -bad.example.com", "is not a host name", 0),
    ("host-empty-label", HOST, "    host: a..example.com", "is not a host name", 0),
    ("host-bad-ipv4", HOST, "    host: 203.0.113.300", "neither an IPv4 address nor a host name", 0),
    ("host-bad-ipv6", HOST, "    host: '2001:db8::1::2'", "is not an IPv6 address", 0),
    ("host-user-at", HOST, "    host: root@203.0.113.12", "is not a host name", 0),
    ("host-space", HOST, "    host: exa mple.com", "is not a host name", 0),
    ("camouflage-url", "        camouflage: www.example.com", "        camouflage: https://www.example.com/",
     "is not an IPv6 address", 0),
    ("listen-port-99999", LISTEN, "    listen: 127.0.0.1:99999", "listen: the port of '127.0.0.1:99999' must be", 0),
    ("listen-port-0", LISTEN, "    listen: 127.0.0.1:0", "must be a number from 1 to 65535", 0),
    ("listen-no-port", LISTEN, "    listen: localhost", "is not HOST:PORT", 0),
    ("listen-fullwidth-port", LISTEN, "    listen: 127.0.0.1:８０８０", "must be a number from 1 to 65535", 0),
    ("listen-bare-ipv6", LISTEN, "    listen: '::1:8080'", "write an IPv6 address in brackets", 0),
    ("listen-bad-bracket", LISTEN, "    listen: '[zz]:8080'", "is not an IPv6 address", 0),
    # Ports everywhere.
    ("port-70000", PORT, "        port: 70000\n", "port: 70000 is out of range", 0),
    ("port-negative", PORT, "        port: -1\n", "is out of range", 0),
    ("port-fraction", PORT, "        port: 80.5\n", "port: expected a whole number", 0),
    ("ssh-port-65536", SSH, "    ssh: {user: root, port: 65536}", "port: 65536 is out of range", 0),
    ("camouflage-port-0", "        camouflage: www.example.com", "        camouflage: www.example.com\n        camouflage_port: 0",
     "camouflage_port: 0 is out of range", 1),
    # Sizes.
    ("size-inf", LIMIT_LINE, "    data_limit: .inf", "is not a size", 0),
    ("size-huge", LIMIT_LINE, "    data_limit: " + "9" * 30 + "PB", "is too large", 0),
    ("size-huge-int", LIMIT_LINE, "    data_limit: " + "9" * 30, "a size must be at most", 0),
    # Structure.
    ("recursive-alias", "    inbounds:\n      - id: fra-2-reality", "    inbounds: &loop\n      - loop: *loop\n        id: fra-2-reality",
     "an alias refers to a list or mapping that contains it", 0),
    ("mapping-as-key", HOST, "    ? {a: 1}\n    : x\n" + HOST, "a key must be text", 0),
]

# (id, whole file, what the error must say, line)
WHOLE: list[tuple[str, str, str, int]] = [
    ("multi-document", "servers: []\n---\nusers: []\n", "found another document", 2),
    ("deep-flow", "users: " + "[" * 5000, "nesting is deeper than", 1),
    ("deep-block", "".join(" " * i + "- \n" for i in range(200)), "nesting is deeper than", 65),
    ("alias-bomb", "settings:\n  a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n"
     + "".join(f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]\n" for i in range(1, 9)), "expands to more than", 1),
    # A flood its bytes do not pay for (the budget is MAX_NODES plus one node per byte read): a list of
    # 1000 items, aliased 100 times, is 100 000 values from 7 KB.
    ("node-flood", "settings: {a: &a [" + "x, " * 1000 + "]}\nusers: [" + "*a, " * 100 + "]\n", "expands to more than", 1),
    ("tag-directive", "%TAG !e! tag:evil.example,2000:\n---\nservers: !e!thing []\n", "tag:evil.example,2000:thing is not", 3),
    ("undefined-alias", "servers: *nope\n", "found undefined alias", 1),
    ("include-flood", "includes: [" + "a.yaml, " * 1000 + "]\n", "more than 256", 1),
    ("nul-escape", 'users: [{name: "a\\0b"}]\n', "NUL character", 1),
]


def bounded(fn: Callable[[], Any], seconds: float = LIMIT) -> Any:
    """``fn()`` in a daemon thread; the test fails (and moves on) when it does not finish in time."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 — handed to the test thread below
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"did not finish within {seconds:g} s (a hang)")
    if "error" in out:
        raise out["error"]
    return out["value"]


def _validate(cli: Any, path: Any) -> Any:
    run = bounded(lambda: cli("validate", str(path)))
    assert run.rc == 1, run.text
    assert "Traceback" not in run.text and "internal error" not in run.text, run.text
    return run


def _located(run: Any, expected: str) -> list[dict[str, str]]:
    errors = [m.groupdict() for m in LOCATION.finditer(run.err)]
    matching = [e for e in errors if expected in e["msg"]]
    assert matching, f"no positioned error says {expected!r}:\n{run.err[:3000]}"
    return matching


@pytest.mark.parametrize("name,old,new,expected,offset", PLANTED, ids=[c[0] for c in PLANTED])
def test_a_hostile_value_is_a_positioned_diagnostic(cli, tmp_path, name, old, new, expected, offset):
    text, line = plant(example_text(), old, new)
    path = tmp_path / "cluster.yaml"
    path.write_text(text, encoding="utf-8")
    run = _validate(cli, path)
    matching = _located(run, expected)
    assert any(int(e["line"]) == line + offset for e in matching), run.err[:3000]
    assert len(run.err) < 20_000  # a huge value is never echoed whole


@pytest.mark.parametrize("name,text,expected,line", WHOLE, ids=[c[0] for c in WHOLE])
def test_a_hostile_document_is_a_positioned_diagnostic(cli, tmp_path, name, text, expected, line):
    path = tmp_path / "cluster.yaml"
    path.write_text(text, encoding="utf-8")
    run = _validate(cli, path)
    assert any(int(e["line"]) == line for e in _located(run, expected)), run.err


# Odd but harmless: these must stay valid (id, text planted, replacement).
VALID: list[tuple[str, str, str]] = [
    ("example-unchanged", HOST, HOST),
    ("duplicate-anchor", HOST, "    host: &h 203.0.113.12\n    region: &h WEU"),  # ruamel warns; -W error made it a crash
    ("merge-key", HOST, "    <<: {coefficient: 1.5}\n" + HOST),
    ("host-ipv6", HOST, "    host: '2001:db8::12'"),
    ("host-trailing-dot", HOST, "    host: fra-2.example.net."),
    ("listen-ipv6", LISTEN, "    listen: '[::1]:8080'"),
    ("listen-name", LISTEN, "    listen: localhost:8080"),
    ("host-key-ed25519", *_ssh(f'host_key: "ssh-ed25519 {ED25519} root@fra-1"')),
    ("expires-datetime", EXPIRES, "    expires: 2027-06-30T12:00:00+02:00"),
]


@pytest.mark.parametrize("name,old,new", VALID, ids=[c[0] for c in VALID])
def test_odd_but_valid_files_stay_valid(cli, tmp_path, name, old, new):
    text, _ = plant(capable_example_text(), old, new)
    path = tmp_path / "cluster.yaml"
    path.write_text(text, encoding="utf-8")
    run = bounded(lambda: cli("validate", str(path)))
    assert run.rc == 0, run.text


# --------------------------------------------------------------------------- files that are not files


@pytest.mark.parametrize("special", ["/dev/zero", "/dev/urandom", "/proc/self/environ", "/proc/self/maps"])
def test_devices_and_proc_files_are_refused_unread(cli, special):
    if not os.path.exists(special):
        pytest.skip(f"{special} does not exist here")
    run = _validate(cli, special)
    assert "not a regular file" in run.err, run.err


def test_a_fifo_is_refused_without_blocking(cli, tmp_path):
    fifo = tmp_path / "cluster.yaml"
    os.mkfifo(fifo)
    run = _validate(cli, fifo)
    assert "FIFO" in run.err


def test_a_file_over_the_size_cap_is_refused_before_parsing(cli, tmp_path):
    path = tmp_path / "cluster.yaml"
    with open(path, "wb") as fh:
        fh.write(b"servers: []\n# ")
        fh.truncate(MAX_FILE_BYTES + 1)  # sparse: refused by its size, never read
    run = _validate(cli, path)
    assert f"more than the {MAX_FILE_BYTES} allowed" in run.err


def test_a_1mb_host_name_is_refused(cli, tmp_path):
    # Within the file size cap now: refused by the host name's own rule, at its place, and not echoed.
    text, line = plant(example_text(), HOST, "    host: " + "a" * 1_000_000)
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    run = _validate(cli, path)
    assert any(int(e["line"]) == line for e in _located(run, "host: is too long")), run.err[:2000]
    assert len(run.err) < 2000


def test_the_shared_reader_refuses_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, why in ((str(fifo), "FIFO"), ("/dev/zero", "character device"), (str(tmp_path), "directory")):
        with pytest.raises(OSError) as info:
            bounded(lambda p=path: read_regular_file(p, 100))
        assert why in str(info.value.strerror)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    with pytest.raises(OSError, match="more than the 100 allowed"):
        read_regular_file(str(big), 100)
    assert read_regular_file(str(big), 101) == b"x" * 101


def test_the_secret_file_and_certificates_go_through_the_shared_reader(tmp_path):
    from reconciler.credentials import load_secret
    from reconciler.errors import SecretError

    with pytest.raises(SecretError, match="character device"):
        bounded(lambda: load_secret(file="/dev/zero"))
    fifo = tmp_path / "secret"
    os.mkfifo(fifo)
    with pytest.raises(SecretError, match="FIFO"):
        bounded(lambda: load_secret(file=str(fifo)))


# --------------------------------------------------------------------------- includes stay in the cluster's folder


def _with_include(tmp_path, include: str, extra_settings: str = "") -> Any:
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    text, _ = plant(capable_example_text(), "# includes: [users.d/*.yaml]", f"includes: [{include}]")
    if extra_settings:
        text, _ = plant(text, "  self_heal: true", f"  self_heal: true\n{extra_settings}")
    (repo / "cluster.yaml").write_text(text)
    return repo / "cluster.yaml"


@pytest.mark.parametrize("include", ["/etc/passwd", "../outside.yaml", "'../*.yaml'", "users.d/../../outside.yaml"])
def test_an_include_outside_the_folder_is_refused_without_showing_it(cli, tmp_path, include):
    (tmp_path / "outside.yaml").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (tmp_path / "repo" / "users.d").mkdir(parents=True)
    path = _with_include(tmp_path, include)
    run = _validate(cli, path)
    assert "reaches outside the cluster's folder" in run.err, run.err
    assert "root:" not in run.text and "/bin/bash" not in run.text


def test_a_symlink_out_of_the_folder_is_refused(cli, tmp_path):
    (tmp_path / "outside.yaml").write_text("users: [{name: mallory}]\n")
    path = _with_include(tmp_path, "users.yaml")
    (tmp_path / "repo" / "users.yaml").symlink_to(tmp_path / "outside.yaml")
    run = _validate(cli, path)
    assert "reaches outside the cluster's folder" in run.err
    assert "mallory" not in run.text


def test_allow_path_allows_a_folder_outside(cli, tmp_path):
    # The operator allows a folder outside the repository on the command line, never in the file (a pull request
    # could edit it): tests/test_trust_paths.py has the rest.
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "team.yaml").write_text("users: [{name: erin}]\n")
    path = _with_include(tmp_path, "../shared/team.yaml")
    run = bounded(lambda: cli("validate", str(path), "--json", "--allow-path", str(shared)))
    assert run.rc == 0, run.text
    assert '"users": 5' in run.out


def test_a_device_inside_the_folder_is_refused(cli, tmp_path):
    path = _with_include(tmp_path, "zero.yaml")
    (tmp_path / "repo" / "zero.yaml").symlink_to("/dev/zero")
    run = _validate(cli, path)
    assert "reaches outside" in run.err or "not a regular file" in run.err


def test_a_fifo_include_is_refused(cli, tmp_path):
    path = _with_include(tmp_path, "pipe.yaml")
    os.mkfifo(tmp_path / "repo" / "pipe.yaml")
    run = _validate(cli, path)
    assert "FIFO" in run.err


@pytest.mark.parametrize("pattern", ["'*/*/*/*/*/*.yaml'", "'**/**/**/**/**/**/**/**/**/**'"])
def test_a_deep_glob_is_refused_fast(cli, tmp_path, pattern):
    path = _with_include(tmp_path, pattern)
    run = _validate(cli, path)
    assert "reaches too far" in run.err, run.err


def test_a_wide_glob_is_bounded(cli, tmp_path, monkeypatch):
    from reconciler.config import includes

    path = _with_include(tmp_path, "'d/*/*'")
    for i in range(30):
        sub = tmp_path / "repo" / "d" / f"s{i}"
        sub.mkdir(parents=True)
        for j in range(30):
            (sub / f"f{j}").touch()
    monkeypatch.setattr(includes, "MAX_GLOB_VISITS", 500)  # 930 entries to look at
    assert "reaches too far" in _validate(cli, path).err
    monkeypatch.setattr(includes, "MAX_GLOB_VISITS", 100_000)  # 900 matches, more than MAX_INCLUDED_FILES
    assert "reaches too far" in _validate(cli, path).err


def test_includes_share_one_byte_budget(cli, tmp_path):
    path = _with_include(tmp_path, "'users.d/*.yaml'")
    (tmp_path / "repo" / "users.d").mkdir()
    each = MAX_TOTAL_BYTES // 3  # each file within MAX_FILE_BYTES, the three of them over the total
    for i in range(3):
        (tmp_path / "repo" / "users.d" / f"u{i}.yaml").write_bytes(b"users: []\n# " + b"x" * each + b"\n")
    run = _validate(cli, path)
    assert f"more than {MAX_TOTAL_BYTES} bytes together" in run.err
