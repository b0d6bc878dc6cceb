"""Property tests: whatever YAML arrives, validate exits 0 or 1 and never shows a traceback (GITOPS-2).

The fuzzers at the end (issue 13) feed the loader itself with byte-level mutations of
the example and with token soup full of tags, anchors, aliases and huge numbers: it
must never raise and never take longer than ``PER_INPUT_LIMIT`` (each input runs in a
thread, so a hang fails instead of stalling). ``RECONCILER_FUZZ_EXAMPLES`` sets the
number of inputs per fuzzer (default 300, about 10 s each); for a long run:

    RECONCILER_FUZZ_EXAMPLES=30000 .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=0 \
        --hypothesis-show-statistics tests/test_properties.py -k fuzz
"""

from __future__ import annotations

import io
import os
import time
from contextlib import redirect_stderr, redirect_stdout

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.cli import main
from reconciler.config import LoadResult, load_cluster
from tests.conftest import example_text
from tests.test_hostile_config import bounded

EXAMPLE_LINES = example_text().splitlines(keepends=True)
YAML_CHARS = " \t\n-:{}[],'\"#&*!|>?%@`abcxyz019."
# Fragments mixing YAML punctuation with the file's own words, so mutations hit real keys.
YAML_FRAGMENTS = st.lists(
    st.sampled_from(list(YAML_CHARS) + ["servers", "port", "route", "inbounds", "- ", ": ", "\n  "]), max_size=40
).map("".join)


def _run(path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["validate", str(path)])
    return rc, out.getvalue() + err.getvalue()


def _assert_clean(rc: int, text: str) -> None:
    assert rc in (0, 1), text
    assert "Traceback" not in text
    assert "internal error" not in text, text


@st.composite
def mutated_example(draw):
    lines = list(EXAMPLE_LINES)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "swap", "insert", "truncate", "indent", "dedent"]))
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "swap" and i + 1 < len(lines):
            lines[i], lines[i + 1] = lines[i + 1], lines[i]
        elif op == "insert":
            lines.insert(i, draw(YAML_FRAGMENTS) + "\n")
        elif op == "truncate":
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))] + "\n"
        elif op == "indent":
            lines[i] = "  " + lines[i]
        elif op == "dedent":
            lines[i] = lines[i][2:] if lines[i].startswith("  ") else lines[i]
        if not lines:
            break
    return "".join(lines)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=mutated_example())
def test_mutated_example_never_crashes(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    _assert_clean(*_run(path))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=YAML_FRAGMENTS)
def test_random_yaml_text_never_crashes(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    _assert_clean(*_run(path))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["name", "id", "port", "route", "pool", "pools", "country", "protocol", "inbounds", "servers",
                         "routes", "users", "settings", "geo", "tls", "host", "x"]), inner, max_size=5),
    max_leaves=25,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.dictionaries(st.sampled_from(["servers", "routes", "users", "settings", "includes"]), json_values, max_size=4))
def test_random_structures_never_crash(tmp_path, doc):
    import json

    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    _assert_clean(*_run(path))


# --------------------------------------------------------------------------- fuzzing the loader (issue 13)

FUZZ_EXAMPLES = int(os.environ.get("RECONCILER_FUZZ_EXAMPLES", "300"))
PER_INPUT_LIMIT = 20.0  # seconds; the slowest input the loader accepts or refuses takes about 2 s
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
EXAMPLE_BYTES = example_text().encode()
HOSTILE = [
    b"!!int ", b"!!float ", b"!!bool ", b"!!null ", b"!!binary ", b"!!timestamp ", b"!!set ", b"!!omap ", b"!!str ",
    b"!!python/object/apply:os.system ", b"!!python/name:os.system ", b"!vault ", b"!<tag:x,2000:y> ", b"!!map ", b"!!seq ",
    b"&a ", b"&b ", b"*a", b"*b", b"<<: *a\n", b"<<: ", b".nan", b".inf", b"-.inf", b"9" * 400, b"9" * 5000, b"1e999",
    b"0x", b"0o8", b"2026-13-01", b"2026-02-30T25:61:61+99:99", b"\t", b"\x00", b"\xff\xfe", b'"\\ud800"',
    b'"\\ud83c\\udde9"', b"%TAG !e! tag:e,2000:\n---\n", b"%YAML 1.1\n---\n", b"---\n", b"...\n", b"? ", b"- ", b": ",
    b"{", b"}", b"[", b"]", b",", b"|", b">-", b"'", b'"', b"#", b"\n  ", b"\r\n", b"\xef\xbb\xbf", b"[" * 300, b"- " * 200,
    b"includes: ['**/**/**/**/**']\n", b"includes: [/etc/passwd]\n", b"includes: [../x.yaml]\n", b"host_key: 'ssh-ed25519 AAAA'",
    b"listen: 1.2.3.4:99999", b"host: ::1::", b"expires: 9999-12-31T23:59:59-23:59",
]
TOKENS = [t.decode("utf-8", "replace") for t in HOSTILE] + [
    "servers:", "routes:", "users:", "settings:", "inbounds:", "- name: a", "port: 1", "id: x", "host: h", "country: DE",
    "protocol: trojan", "tls: {server_name: x}", "report_interval: ", "\n", "\n    ", " ", "x", "1",
]


@st.composite
def mutated_bytes(draw):
    """The example with byte flips, truncations, deletions, copies of its own lines and hostile insertions."""
    data = bytearray(EXAMPLE_BYTES)
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.sampled_from(["flip", "truncate", "delete", "copy", "insert", "insert", "random"]))
        pos = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            data[min(pos, len(data) - 1)] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[pos:]
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 64))]
        elif op == "copy" and data:
            start = draw(st.integers(0, len(data) - 1))
            data[pos:pos] = data[start:start + draw(st.integers(1, 400))]
        elif op == "insert":
            data[pos:pos] = draw(st.sampled_from(HOSTILE))
        elif op == "random":
            data[pos:pos] = draw(st.binary(max_size=16))
    return bytes(data)


def _load_bounded(path) -> LoadResult:
    start = time.monotonic()
    result = bounded(lambda: load_cluster(str(path)), PER_INPUT_LIMIT)
    assert time.monotonic() - start < PER_INPUT_LIMIT
    assert isinstance(result, LoadResult)
    assert result.ok or result.errors  # an invalid file always says why
    assert all(len(d.message) < 2000 for d in result.diagnostics)  # nothing is echoed whole
    return result


@FUZZ
@given(data=mutated_bytes())
def test_fuzz_mutated_example_never_raises_or_hangs(tmp_path, data):
    path = tmp_path / "cluster.yaml"
    path.write_bytes(data)
    _load_bounded(path)


@FUZZ
@given(text=st.lists(st.sampled_from(TOKENS), max_size=60).map("".join))
def test_fuzz_token_soup_never_raises_or_hangs(tmp_path, text):
    path = tmp_path / "cluster.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _load_bounded(path)
