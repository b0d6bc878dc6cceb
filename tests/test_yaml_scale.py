"""Loading at scale (issue 17): a million users on one controller, as safely as 5 000 were.

Every file is parsed by libyaml, whatever its size (ruamel's pure parser only where libyaml
is missing), and the same composer turns either parser's events into the same nodes. These
tests pin what that promises: positions in a 100 000-user file, the two parsers' identical
data and source maps on tricky YAML (and both identical to ruamel's own composer, the
pipeline before), one diagnostic for a slip whatever the file's size, and the hostile
cases — deep nesting, alias bombs, floods — refused by either parser, with budgets that
grow with honest bytes.
"""

from __future__ import annotations

import gc
import io
import math
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from reconciler import gcpause
from reconciler.config import yamlread
from reconciler.config.diagnostics import SourceMap
from reconciler.config.loader import load_cluster
from reconciler.config.yamlread import MAX_DEPTH, MAX_NODES, Budget, parse_yaml
from reconciler.errors import Problem
from tests.conftest import example_text

pytestmark = pytest.mark.skipif(yamlread._C_LOADER is None, reason="PyYAML without libyaml")


def _users(n: int, start: int = 0) -> str:
    return "".join(f"  - {{name: u{i}, data_limit: 100GB}}\n" for i in range(start, start + n))


def _parsed(text: str, parser: str | None = None) -> tuple[Any, SourceMap]:
    return parse_yaml(text, "f.yaml", Budget(), parser=parser)


def _same(a: tuple[Any, SourceMap], b: tuple[Any, SourceMap]) -> None:
    assert repr(a[0]) == repr(b[0])  # repr: NaN equals itself, and bool/int/float stay apart
    assert a[1].keys == b[1].keys
    assert a[1].values == b[1].values


# --------------------------------------------------------------------------- 100 000 users


def test_100k_users_load_with_their_positions(tmp_path):
    lines = _users(100_000).splitlines(keepends=True)
    bad = 99_998  # user 99,999
    lines[bad] = lines[bad].replace("100GB", "100XB")
    text = example_text() + "".join(lines)
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    result = load_cluster(str(path))
    assert [(d.line, d.col) for d in result.errors] == [
        (example_text().count("\n") + bad + 1, lines[bad].index("100XB") + 1)]
    assert "data_limit: '100XB' is not a size" in result.errors[0].message

    path.write_text(example_text() + _users(100_000))
    result = load_cluster(str(path))
    assert result.ok, [d.render() for d in result.errors[:5]]
    assert len(result.cluster.users) == 100_004  # the example's four, and these
    assert result.source.value(("users", 100_003, "data_limit")) == yamlread.Pos(
        str(path), example_text().count("\n") + 100_000, len("  - {name: u99999, data_limit: ") + 1)


def test_users_split_by_includes_keep_their_files_and_lines(tmp_path):
    text = example_text().replace("# includes: [users.d/*.yaml]", "includes: [users.d/*.yaml]")
    (tmp_path / "cluster.yaml").write_text(text)
    (tmp_path / "users.d").mkdir()
    for part in range(2):
        (tmp_path / "users.d" / f"{part}.yaml").write_text("users:\n" + _users(20_000, part * 20_000))
    (tmp_path / "users.d" / "1.yaml").write_text(
        "users:\n" + _users(20_000, 20_000).replace("u39000, data_limit: 100GB", "u39000, data_limit: -1"))
    result = load_cluster(str(tmp_path / "cluster.yaml"))
    assert [(d.file.rsplit("/", 1)[-1], d.line) for d in result.errors] == [("1.yaml", 19_000 + 2)]


# --------------------------------------------------------------------------- libyaml and ruamel agree

CORPUS = {
    "anchors": "base: &b {a: 1, b: [x, y]}\nuse: *b\nlist: &l [1, 2]\nagain: [*l, *l]\nscalar: &s text\ns2: *s\n",
    "merge": "base: &b {a: 1, b: 2}\nc:\n  <<: *b\n  b: 3\nd: {<<: [*b, {e: 5}], f: 6}\n",
    "merge-inline": "c:\n  <<: {x: 1}\n  y: 2\n",
    "block-and-flow": "a:\n  - b\n  - {c: d, e: [f, g]}\n  - - h\n    - i\n  -\n    j: k\nl: [m, {n: o}, [p]]\nq: {}\nr: []\n",
    "multi-line-strings": (
        "lit: |\n  one\n  two\n\nfold: >\n  three\n  four\n\n  five\nkeep: |+\n  six\n\nstrip: >-\n  seven\n"
        "indent: |2\n    eight\n   nine\nplain: ten\n  eleven\n\n  twelve\n"
        "dq: \"a\\tb\\u00e9\\x41\\n\n  c \\\n  d\"\nsq: 'it''s\n\n  e'\n"),
    "explicit-tags": (
        "s: !!str 123\ni: !!int \"42\"\nf: !!float 1\nb: !!bool true\nn: !!null ''\nt: !!timestamp 2026-01-02\n"
        "m: !!map {a: 1}\nq: !!seq [1]\nv: !<tag:yaml.org,2002:str> verbatim\nbang: ! 12\n"),
    "yaml-1.1-literals": (
        "y: yes\nn: no\non: on\noff: off\nY: Y\noct: 0o17\nold-oct: 017\nsexa: 1:30\nsexf: 1:30.5\nbin: 0b101\nhex: 0x1F\n"
        "under: 1_000\ninf: .inf\nninf: -.Inf\nnan: .NaN\ntilde: ~\nnul: null\nNul: Null\nempty:\n"
        "date: 2026-06-30\nts: 2001-12-14 21:59:43.10 -5\ntsz: 2001-12-14T21:59:43Z\nexp: 1e3\nfl: 3.\n"),
    "yaml-1.1-directive": "%YAML 1.1\n---\nb: true\nnil: ~\ni: 0x1F\nf: 1.5\n",
    "empty-values": (
        "a:\nb: 1\nc:\n  d:\n  e:\n# comment\nf: {g: , h}\nl: [i: , ? j]\nm:\n  - \n  - n\n"
        "o: # trailing\np:\n"),
    "explicit-keys": "? a\n: 1\n? b\n? c\n: 3\nd: 4\n? |\n  block key\n: v\n",
    "tag-then-anchor": "a: !!str &x 5\nb: *x\nc: &y !!str 6\nd: *y\ne: !!map &z {f: 1}\n",
    "document-markers": "--- \na: 1\n...\n",
    "unicode": "flag: \"🇩🇪\"\nname: 東京\nemoji: 🚀 fast\n\"quoted key\": v\n'single key': w\nkey with spaces: x\n",
    "crlf": "a: 1\r\nb:\r\n  - c\r\n  - d\r\ne:\r\n",
    "no-final-newline": "a:\n  b:\n  c:",
    "no-final-newline-flow": "a: {b: }",
    "comments": "# head\na: 1 # one\n# between\nb:   # nothing\n  - c # item\n",
    "example": example_text(),
}


@pytest.mark.parametrize("name", list(CORPUS))
def test_libyaml_and_ruamel_give_the_same_data_and_positions(name):
    text = CORPUS[name]
    ruamel = _parsed(text, "ruamel")
    _same(_parsed(text, "libyaml"), ruamel)
    # and the pure path is the pipeline it replaced: ruamel's own composer, then the same conversion
    node = YAML(typ="safe", pure=True).compose(text)
    source = SourceMap(root=ruamel[1].root)
    _same((yamlread._Converter("f.yaml", source, Budget()).value(node, ()), source), ruamel)


# Whatever ruamel writes, in block or flow style, at any width and indentation: libyaml reads the same values at the
# same places (or, in a few corners, refuses what ruamel reads: ``[:7]``). Text without NEL, LS and PS, which libyaml
# counts as line breaks and ruamel does not, and without lone surrogates, which each refuses in its own words.
_CHARS = st.characters(blacklist_characters="\x85\u2028\u2029", blacklist_categories=("Cs",))
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats() | st.text(_CHARS, max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(_CHARS, min_size=1, max_size=8), inner, max_size=4),
    max_leaves=30)


@settings(max_examples=150, deadline=None, database=None)
@given(doc=st.dictionaries(st.text(_CHARS, min_size=1, max_size=8), _VALUES, min_size=1, max_size=5),
       flow=st.sampled_from([False, True, None]), width=st.sampled_from([20, 80, 4096]),
       indent=st.sampled_from([(2, 2, 0), (4, 4, 2), (2, 4, 2)]))
def test_what_ruamel_writes_both_parsers_read_alike(doc, flow, width, indent):
    writer = YAML(typ="safe", pure=True)
    writer.default_flow_style, writer.width = flow, width
    writer.indent(mapping=indent[0], sequence=indent[1], offset=indent[2])
    out = io.StringIO()
    writer.dump(doc, out)
    try:
        libyaml = _parsed(out.getvalue(), "libyaml")
    except Problem:
        return
    _same(libyaml, _parsed(out.getvalue(), "ruamel"))


def test_the_corpus_means_what_yaml_1_2_core_says():
    data, _ = _parsed(CORPUS["yaml-1.1-literals"], "libyaml")
    assert (data["y"], data["on"], data["Y"]) == ("yes", "on", "Y")  # YAML 1.2: not booleans
    assert (data["oct"], data["old-oct"], data["sexa"], data["bin"], data["hex"]) == (15, 17, "1:30", 5, 31)
    assert data["inf"] == math.inf and math.isnan(data["nan"]) and data["tilde"] is None and data["empty"] is None
    assert _parsed(CORPUS["explicit-tags"], "libyaml")[0]["s"] == "123"
    for parser in ("ruamel", "libyaml"):  # under %YAML 1.1, yes is a boolean and 1:30 a number, both refused as before
        with pytest.raises(Problem, match="'yes' is not true or false"):
            _parsed("%YAML 1.1\n---\na: yes\n", parser)
        with pytest.raises(Problem, match="'1:30' is not a whole number"):
            _parsed("%YAML 1.1\n---\na: 1:30\n", parser)


@pytest.mark.parametrize("text", ["a: b\n---\nc: d\n", "a: *nope\n", "a: !custom x\n", "a: 1\na: 2\n", "a: [1\n"])
def test_both_parsers_refuse_the_same_files_at_the_same_line(text):
    refused = []
    for parser in ("ruamel", "libyaml"):
        with pytest.raises(Problem) as info:
            _parsed(text, parser)
        refused.append(info.value.diagnostic)
    assert refused[0].line == refused[1].line and refused[0].code == refused[1].code


def test_a_yaml_directive_of_another_version_is_a_diagnostic_not_a_crash():
    for parser in ("ruamel", "libyaml"):
        with pytest.raises(Problem, match="incompatible YAML document") as info:
            _parsed("# head\n%YAML 1.3\n---\na: 1\n", parser)
        assert info.value.diagnostic.line == 2


# --------------------------------------------------------------------------- hostile files, either parser


@pytest.mark.parametrize("parser", ["ruamel", "libyaml"])
@pytest.mark.parametrize("text,line", [
    ("".join(" " * i + "- \n" for i in range(200)), MAX_DEPTH + 1),
    ("a: " + "[" * 200 + "]" * 200 + "\n", 1),
    ("a: " + "{b: " * 200 + "}" * 200 + "\n", 1),
])
def test_deep_nesting_is_refused_without_recursion(parser, text, line):
    with pytest.raises(Problem) as info:
        _parsed(text, parser)
    d = info.value.diagnostic
    assert d.message == f"YAML syntax: nesting is deeper than {MAX_DEPTH} levels" and d.line == line


@pytest.mark.parametrize("users", [0, 20_000], ids=["small", "large"])
def test_a_slip_gets_the_same_diagnostic_whatever_the_size_of_its_file(tmp_path, users):
    # One parser for every size: a tab in indentation, a ':' in a plain value, a tab where YAML allows white space
    path = tmp_path / "cluster.yaml"
    text = example_text() + _users(users) + "  - name: tabbed\n\tdata_limit: 1GB\n"
    path.write_text(text)
    [error] = load_cluster(str(path)).errors
    assert (error.line, error.col, error.code) == (text.count("\n"), 1, "tab")
    assert error.message == "YAML syntax: tab character in indentation"
    slipped = example_text() + _users(users) + "  - name: a: b\n"
    path.write_text(slipped)
    [error] = load_cluster(str(path)).errors
    assert error.message == "YAML syntax: mapping values are not allowed in this context"
    assert (error.line, error.col) == (slipped.count("\n"), len("  - name: a") + 1)
    path.write_text(example_text() + _users(users) + "  - {name: spaced,\tdata_limit: 1GB}\n")  # white space in flow
    assert load_cluster(str(path)).ok


def test_deep_nesting_in_a_large_file_is_refused():
    text = "a: " + "[" * 300_000 + "\n" + "# " + "x" * (1 << 20) + "\n"  # unclosed, and too deep long before that
    with pytest.raises(Problem, match="nesting is deeper than"):
        _parsed(text)


BOMB = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]\n" for i in range(1, 9))


@pytest.mark.parametrize("parser", ["ruamel", "libyaml"])
def test_an_alias_bomb_is_refused(parser):
    with pytest.raises(Problem, match="expands to more than") as info:
        _parsed(BOMB, parser)
    assert (info.value.diagnostic.line, info.value.diagnostic.code) == (1, "size")


def test_an_alias_bomb_in_a_large_file_is_refused():
    """Its bytes pay for about a million nodes; the bomb expands to a thousand million."""
    budget = Budget()
    text = "# " + "x" * 1_000_000 + "\n" + BOMB
    budget.read(len(text), "f.yaml")
    with pytest.raises(Problem, match=f"expands to more than {MAX_NODES + len(text)} values"):
        parse_yaml(text, "f.yaml", budget)


def test_budgets_grow_with_the_bytes_read():
    flood = "users: [" + "a, " * 100_000 + "]\n"  # 200 000 nodes, paid by its 300 000 bytes
    with pytest.raises(Problem, match=f"expands to more than {MAX_NODES} values"):
        parse_yaml(flood, "f.yaml", Budget())  # text that was never read pays nothing
    budget = Budget()
    budget.read(len(flood), "f.yaml")
    data, _ = parse_yaml(flood, "f.yaml", budget)
    assert len(data["users"]) == 100_000
    aliased = "a: &a [" + "x, " * 1000 + "]\nusers: [" + "*a, " * 100 + "]\n"  # 100 000 values from 7 KB
    budget = Budget()
    budget.read(len(aliased), "f.yaml")
    with pytest.raises(Problem, match="expands to more than"):
        parse_yaml(aliased, "f.yaml", budget)


# --------------------------------------------------------------------------- the collector and the reload budget


def test_the_collector_is_paused_only_while_parsing_and_restored():
    assert gc.isenabled()
    _parsed(CORPUS["anchors"])
    assert gc.isenabled()
    with pytest.raises(Problem):
        _parsed(BOMB)
    assert gc.isenabled()
    gc.disable()
    try:
        _parsed(CORPUS["anchors"])
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()
    errors: list[BaseException] = []

    def parse_many() -> None:
        try:
            for _ in range(20):
                _parsed(CORPUS["merge"])
        except BaseException as exc:  # noqa: BLE001 — handed to the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=parse_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and gc.isenabled()  # overlapping loads in threads: on again after the last
    with gcpause.paused():
        gcpause.paused.forked()  # as in a child forked while a thread was loading
        assert gc.isenabled() and gcpause.paused.holders == 0
    assert gc.isenabled() and gcpause.paused.holders == 0


def test_the_reload_budget_grows_with_the_yaml_it_may_read(tmp_path):
    main = tmp_path / "cluster.yaml"
    main.write_text("x" * 1_000_000)
    assert yamlread.load_seconds(str(main), 30) == pytest.approx(32, abs=0.1)
    (tmp_path / "users.d").mkdir()
    (tmp_path / "users.d" / "a.yaml").write_text("x" * 3_000_000)
    (tmp_path / "notes.txt").write_text("x" * 5_000_000)  # not YAML: not counted
    assert yamlread.load_seconds(str(main), 30) == pytest.approx(38, abs=0.1)
    assert yamlread.load_seconds(str(tmp_path / "nowhere" / "cluster.yaml"), 30) == 30


def test_a_flood_of_bad_records_is_told_not_hoarded(tmp_path):
    # A small file with thousands of broken users gets the first 200 errors and a count, never one error object
    # per record kept (at 64 MiB that would be tens of millions).
    from reconciler.config.loader import MAX_ERRORS

    for name, text in (("items", "users: [" + "a, " * 5000 + "]\n"),
                       ("fields", "users:\n" + "".join(f"  - {{name: 'BAD NAME {i}'}}\n" for i in range(5000)))):
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        result = load_cluster(str(path))
        assert result.cluster is None and len(result.diagnostics) == MAX_ERRORS + 1, name
        assert any("more" in d.message and "4800" in d.message for d in result.diagnostics), name
