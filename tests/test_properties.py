"""Property tests: whatever YAML arrives, validate exits 0 or 1 and never shows a traceback (GITOPS-2)."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.cli import main
from tests.conftest import example_text

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
