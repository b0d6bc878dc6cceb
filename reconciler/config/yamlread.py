"""One YAML file → plain data and a source map, with every cost bounded before it is paid.

Called by the loader for the cluster file and each include (and for any document
``load_document`` reads). The file is hostile input until proven otherwise:

- it is read through ``safe_read`` (regular files only, at most ``MAX_FILE_BYTES``);
- the parser counts nodes *while composing* and stops at the shared ``Budget``, and
  the conversion counts again as it expands aliases ("billion laughs");
- ruamel only tokenises and composes; the values are built here, from the plain
  YAML 1.2 core types — str, int, float, bool, null, timestamp, seq, map and the
  ``<<`` merge key. Any other tag (``!!binary``, ``!!python/...``, ``!!set``,
  ``!custom``) and any scalar its tag cannot hold (``!!int abc``, ``2026-13-01``)
  is a ``Problem`` at the node's ``file:line:col``, never an exception.

Limits, and why: pure-Python ruamel composes about 35 000 nodes or 1 MB of
comments per second on one core, and a cluster file is small — the example is
6 KB and 700 nodes; 5 000 users with a region each are 25 000 nodes. So one
cluster (the file and all its includes together) may hold ``MAX_NODES`` = 60 000
nodes and ``MAX_TOTAL_BYTES`` = 1 MiB, one file at most ``MAX_FILE_BYTES`` =
512 KiB: the worst accepted or refused load takes about 2 s, and a 16 MB file is
refused before a byte of it is parsed (it took 40 s and over 1 GB).
"""

from __future__ import annotations

import datetime as dt
import errno
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.composer import Composer
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from reconciler.config.diagnostics import Diagnostic, Path, Pos, SourceMap, at
from reconciler.safe_read import read_regular_file

#: Nodes (after alias expansion) the cluster file and all its includes may hold together.
MAX_NODES = 60_000
#: Bytes of one file, checked before parsing starts.
MAX_FILE_BYTES = 512 * 1024
#: Bytes of the cluster file and all its includes together.
MAX_TOTAL_BYTES = 1024 * 1024
#: Nesting depth of collections; a cluster file needs about 8.
MAX_DEPTH = 64

_TAG = "tag:yaml.org,2002:"
_INT = re.compile(r"^[-+]?(0|[1-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+|0b[01_]+|[0-9][0-9_]*)$")
_TIMESTAMP = re.compile(
    r"^(?P<year>[0-9]{4})-(?P<month>[0-9]{1,2})-(?P<day>[0-9]{1,2})"
    r"(?:(?:[Tt]|[ \t]+)(?P<hour>[0-9]{1,2}):(?P<minute>[0-9]{2}):(?P<second>[0-9]{2})"
    r"(?:\.(?P<fraction>[0-9]*))?"
    r"(?:[ \t]*(?P<tz>Z|(?P<tz_sign>[-+])(?P<tz_hour>[0-9]{1,2})(?::?(?P<tz_minute>[0-9]{2}))?))?)?$"
)
_BOOLS = {"true": True, "false": False}


class Problem(Exception):
    """A file cannot be read or parsed; ``diagnostic`` says where and why."""

    def __init__(self, diagnostic: Diagnostic):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


class _TooLarge(Exception):
    pass


@dataclass
class Budget:
    """Nodes and bytes left for the cluster file and its includes together."""

    nodes: int = MAX_NODES
    bytes: int = MAX_TOTAL_BYTES

    def spend(self) -> None:
        self.nodes -= 1
        if self.nodes < 0:
            raise _TooLarge

    def read(self, n: int, display: str) -> None:
        self.bytes -= n
        if self.bytes < 0:
            raise Problem(Diagnostic("error", f"the cluster file and its includes are more than {MAX_TOTAL_BYTES} bytes together",
                                     "keep the cluster smaller; move what is not cluster state out of it", file=display, code="size"))


def _too_large(display: str) -> Problem:
    return Problem(Diagnostic(
        "error", f"the cluster expands to more than {MAX_NODES} values (this file and its includes together)",
        "anchors and aliases multiply content; write the data out, or split the cluster", display, 1, 1, "size"))


def read_text(path: str, display: str, overrides: dict[str, str] | None = None, budget: Budget | None = None) -> str:
    """The file's text (or its override), bounded and decoded; ``Problem`` when it cannot be had."""
    budget = budget or Budget()
    override = overrides.get(os.path.abspath(path)) if overrides else None
    if override is not None:
        if len(override) > MAX_FILE_BYTES:
            raise Problem(Diagnostic("error", f"more than the {MAX_FILE_BYTES} bytes allowed in one file",
                                     "split it with includes", file=display, code="file"))
        budget.read(len(override.encode("utf-8", "surrogatepass")), display)
        return override
    try:
        raw = read_regular_file(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        raise Problem(Diagnostic("error", "file not found", "check the path", file=display, code="file")) from None
    except IsADirectoryError:
        raise Problem(Diagnostic("error", "is a directory, not a file", file=display, code="file")) from None
    except OSError as exc:
        hint = "split it with includes" if exc.errno == errno.EFBIG else None
        raise Problem(Diagnostic("error", f"cannot read: {exc.strerror}", hint, file=display, code="file")) from None
    except ValueError as exc:  # e.g. an embedded NUL in a path
        raise Problem(Diagnostic("error", f"cannot read: {exc}", file=display, code="file")) from None
    budget.read(len(raw), display)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise Problem(Diagnostic("error", "not UTF-8 text", "save the file as UTF-8", display, line, 1, "encoding")) from None


def read_yaml(path: str, display: str, overrides: dict[str, str] | None = None,
              budget: Budget | None = None) -> tuple[Any, SourceMap]:
    """Parse one file into plain data and its source map; ``Problem`` on any failure.

    ``overrides`` maps absolute paths to text standing in for the file (an edit being
    validated before it is written). ``budget`` is shared by a cluster's files.
    """
    budget = budget or Budget()
    text = read_text(path, display, overrides, budget)
    return parse_yaml(text, display, budget)


def parse_yaml(text: str, display: str, budget: Budget) -> tuple[Any, SourceMap]:
    class CountingComposer(Composer):
        def __init__(self, loader: Any = None) -> None:
            super().__init__(loader)
            self.warn_double_anchors = False  # a warning would be an exception under -W error

        def compose_node(self, parent: Any, index: Any) -> Any:
            budget.spend()
            return super().compose_node(parent, index)

    yaml = YAML(typ="safe", pure=True)
    yaml.Composer = CountingComposer
    yaml.max_depth = MAX_DEPTH
    try:
        node = yaml.compose(text)
    except _TooLarge:
        raise _too_large(display) from None
    except MarkedYAMLError as exc:
        raise Problem(yaml_error(exc, text, display)) from None
    except YAMLError as exc:
        raise Problem(Diagnostic("error", f"YAML error: {str(exc)[:200]}", file=display, line=1, col=1, code="yaml")) from None
    except RecursionError:
        raise Problem(Diagnostic("error", "nesting is too deep", file=display, line=1, col=1, code="yaml")) from None
    source = SourceMap(root=Pos(display, 1, 1))
    if node is None:
        return None, source
    try:
        return _Converter(display, source, budget).value(node, ()), source
    except _TooLarge:
        raise _too_large(display) from None
    except RecursionError:
        raise Problem(Diagnostic("error", "nesting is too deep", file=display, line=1, col=1, code="yaml")) from None


def yaml_error(exc: MarkedYAMLError, text: str, display: str) -> Diagnostic:
    """A parser error as a diagnostic at its mark, with a hint for the common slips."""
    mark = exc.problem_mark or exc.context_mark
    line = (mark.line + 1) if mark else 1
    col = (mark.column + 1) if mark else 1
    problem = (exc.problem or exc.context or "invalid YAML").strip()
    lines = text.splitlines()
    offending = lines[line - 1] if 0 < line <= len(lines) else ""
    code = "yaml"
    if "\t" in offending or "'\\t'" in problem:
        code = "tab"
        col = (offending.index("\t") + 1) if "\t" in offending else col
        problem = "tab character in indentation"
        hint = "YAML indents with spaces only; replace the tab with spaces"
    elif "maximum depth" in problem:
        problem = f"nesting is deeper than {MAX_DEPTH} levels"
        hint = "a cluster file needs a handful of levels; check the brackets"
    elif "mapping values are not allowed" in problem:
        hint = "a ':' inside a value needs quotes, or the indentation is off"
    elif "expected <block end>" in problem or "could not find expected ':'" in problem:
        hint = "check the indentation of this line against the lines above"
    else:
        hint = "fix the YAML syntax at this position"
    return Diagnostic("error", f"YAML syntax: {problem[:200]}", hint, display, line, col, code)


class _Converter:
    """Composed nodes → plain data, positions into the source map, every node paid from the budget."""

    def __init__(self, display: str, source: SourceMap, budget: Budget):
        self.display = display
        self.source = source
        self.budget = budget
        self.open: set[int] = set()  # collections being converted: an alias to one of them is a cycle

    def pos(self, node: Node) -> Pos:
        return Pos(self.display, node.start_mark.line + 1, node.start_mark.column + 1)

    def fail(self, node: Node, message: str, hint: str | None, code: str = "yaml") -> Problem:
        return Problem(at("error", self.pos(node), message, hint, code))

    def value(self, node: Node, path: Path) -> Any:
        self.budget.spend()
        if isinstance(node, ScalarNode):
            try:
                return self.scalar(node)
            except Problem as problem:  # name the field, as the schema's errors do
                name = next((p for p in reversed(path) if isinstance(p, str)), None)
                d = problem.diagnostic
                if name is None or d.code == "encoding":
                    raise
                raise Problem(Diagnostic(d.severity, f"{name[:64]}: {d.message}", d.hint, d.file, d.line, d.col, d.code)) from None
        if id(node) in self.open:
            raise self.fail(node, "an alias refers to a list or mapping that contains it",
                            "a cluster file cannot hold a cycle; write the data out", "alias")
        self.open.add(id(node))
        try:
            if isinstance(node, SequenceNode):
                self.expect(node, "seq")
                items = []
                for i, item in enumerate(node.value):
                    child = (*path, i)
                    self.source.keys[child] = self.source.values[child] = self.pos(item)
                    items.append(self.value(item, child))
                return items
            if isinstance(node, MappingNode):
                self.expect(node, "map")
                return self.mapping(node, path)
        finally:
            self.open.discard(id(node))
        raise self.fail(node, "unexpected YAML node", None)  # pragma: no cover — ruamel composes only these three

    def expect(self, node: Node, kind: str) -> None:
        if node.tag != _TAG + kind:
            raise self.fail(node, f"the YAML tag {_short(node.tag)} is not accepted here", _TAG_HINT, "tag")

    def mapping(self, node: MappingNode, path: Path) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        explicit: dict[Any, Node] = {}
        merged: list[tuple[Any, Any, Pos | None, Pos | None]] = []
        for key_node, value_node in node.value:
            if key_node.tag == _TAG + "merge":
                merged.extend(self.merge(value_node, path))
                continue
            if not isinstance(key_node, ScalarNode):
                raise self.fail(key_node, "a key must be text, not a list or mapping", "write the key as plain text", "type")
            self.budget.spend()
            key = self.key(key_node)
            if key in explicit:
                first = explicit[key]
                raise self.fail(key_node, f"duplicate key {key!r} (first at line {first.start_mark.line + 1})",
                                "each key may appear once in a mapping; remove or rename one of them", "duplicate-key")
            explicit[key] = key_node
            child = (*path, key)
            self.source.keys[child] = self.pos(key_node)
            self.source.values[child] = self.pos(value_node)
            out[key] = self.value(value_node, child)
        for key, value, kpos, vpos in merged:  # YAML merge: keys written out win over merged ones
            if key not in out:
                out[key] = value
                if kpos and vpos:
                    self.source.keys[(*path, key)] = kpos
                    self.source.values[(*path, key)] = vpos
        return out

    def merge(self, node: Node, path: Path) -> list[tuple[Any, Any, Pos | None, Pos | None]]:
        sources = node.value if isinstance(node, SequenceNode) else [node]
        pairs: list[tuple[Any, Any, Pos | None, Pos | None]] = []
        for src in sources:
            if not isinstance(src, MappingNode):
                raise self.fail(src, "`<<` merges a mapping (or a list of mappings) into this one",
                                "write `<<: *anchor` where the anchor names a mapping", "merge")
            scratch = SourceMap(root=self.source.root)
            sub = _Converter(self.display, scratch, self.budget)
            sub.open = self.open
            data = sub.value(src, ())
            for key, value in data.items():
                pairs.append((key, value, scratch.keys.get((key,)), scratch.values.get((key,))))
                for table, sub_table in ((self.source.keys, scratch.keys), (self.source.values, scratch.values)):
                    for p, pos in sub_table.items():
                        if len(p) > 1 and p[0] == key:
                            table.setdefault((*path, *p), pos)
        return pairs

    def key(self, node: ScalarNode) -> Any:
        value = self.scalar(node)
        if isinstance(value, bool) or value is None:
            return "null" if value is None else str(value).lower()
        if isinstance(value, (int, float, str)):
            return value
        return str(value)

    def scalar(self, node: ScalarNode) -> Any:
        tag = node.tag or ""
        text: str = node.value
        if not tag.startswith(_TAG):
            raise self.fail(node, f"the YAML tag {_short(tag)} is not accepted here", _TAG_HINT, "tag")
        kind = tag[len(_TAG):]
        if kind == "str":
            return _clean_text(text, self.pos(node))
        if kind == "null":
            if text not in ("", "~", "null", "Null", "NULL"):
                raise self.fail(node, f"!!null holds nothing, not {_shown(text)}", "remove the tag or the value", "tag")
            return None
        if kind == "bool":
            if text.lower() not in _BOOLS:
                raise self.fail(node, f"{_shown(text)} is not true or false", "write true or false", "type")
            return _BOOLS[text.lower()]
        if kind == "int":
            return self.integer(node, text)
        if kind == "float":
            return self.float(node, text)
        if kind == "timestamp":
            return self.timestamp(node, text)
        raise self.fail(node, f"the YAML tag {_short(tag)} is not accepted here", _TAG_HINT, "tag")

    def integer(self, node: ScalarNode, text: str) -> int:
        if not _INT.match(text):
            raise self.fail(node, f"{_shown(text)} is not a whole number", "remove the !!int tag or write digits", "type")
        digits = text.replace("_", "")
        sign = -1 if digits.startswith("-") else 1
        digits = digits.lstrip("+-")
        base = {"0x": 16, "0o": 8, "0b": 2}.get(digits[:2].lower(), 10)
        try:
            return sign * int(digits[2:] if base != 10 else digits, base)
        except ValueError:  # no digits after the prefix, or more digits than Python converts
            raise self.fail(node, f"{_shown(text)} is not a usable whole number", "write a number of sane size", "type") from None

    def float(self, node: ScalarNode, text: str) -> float:
        lowered = text.replace("_", "").lower()
        special = {".nan": math.nan, ".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf}
        if lowered in special:
            return special[lowered]
        try:
            return float(lowered)
        except ValueError:
            raise self.fail(node, f"{_shown(text)} is not a number", "remove the !!float tag or write a number", "type") from None

    def timestamp(self, node: ScalarNode, text: str) -> dt.date | dt.datetime:
        m = _TIMESTAMP.match(text.strip())
        hint = "write dates as YYYY-MM-DD (or YYYY-MM-DDTHH:MM:SSZ)"
        if not m:
            raise self.fail(node, f"{_shown(text)} is not a date", hint, "type")
        g = m.groupdict()
        try:
            if g["hour"] is None:
                return dt.date(int(g["year"]), int(g["month"]), int(g["day"]))
            fraction = int((g["fraction"] or "0")[:6].ljust(6, "0"))
            tz: dt.tzinfo | None = None
            if g["tz"]:
                minutes = 0 if g["tz"] == "Z" else int(g["tz_hour"]) * 60 + int(g["tz_minute"] or 0)
                tz = dt.timezone(dt.timedelta(minutes=-minutes if g["tz_sign"] == "-" else minutes))
            return dt.datetime(int(g["year"]), int(g["month"]), int(g["day"]), int(g["hour"]), int(g["minute"]),
                               int(g["second"]), fraction, tzinfo=tz)
        except ValueError as exc:  # month 13, day 32, hour 25, an offset of a day or more
            raise self.fail(node, f"{_shown(text)} is not a valid date: {exc}", hint, "date") from None


_TAG_HINT = "a cluster file holds plain text, numbers, true/false, dates, lists and mappings; remove the tag"


def _short(tag: str | None) -> str:
    tag = tag or "?"
    return ("!!" + tag[len(_TAG):] if tag.startswith(_TAG) else tag)[:80]


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "…")


def _clean_text(text: str, pos: Pos | None) -> str:
    """Join UTF-16 surrogate pairs written as escapes ("\\ud83c\\udde9"); refuse lone surrogates and NUL."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            text = text.encode("utf-16", "surrogatepass").decode("utf-16")
        except UnicodeDecodeError:
            raise Problem(at("error", pos, "text contains an invalid \\u escape (a lone UTF-16 surrogate)",
                             "write the character itself, or a valid escape", "encoding")) from None
    if "\x00" in text:
        raise Problem(at("error", pos, "text contains a NUL character", "remove the \\0 escape", "encoding"))
    return text
