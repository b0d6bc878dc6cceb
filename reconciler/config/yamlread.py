"""One YAML file → plain data and a source map, with every cost bounded before it is paid.

Called by the loader for the cluster file and each include (and for any document
``load_document`` reads). The file is hostile input until proven otherwise:

- it is read through ``safe_read`` (regular files only, at most ``MAX_FILE_BYTES``);
- the composer counts nodes *while composing* and stops at the shared ``Budget`` (the
  diagnostic at the node where it ran out), and the conversion counts again as it expands
  aliases ("billion laughs");
- given the schema's ``TopLevel`` (the loader's, from the model), the composer stops the
  file at the first top-level key the schema does not hold, or a list where it holds a
  mapping (or the other way round), *before* it composes what that key holds: a 16 MB
  list under an unknown key costs a few events, not millions of nodes;
- the parsers only produce events; the composer here builds the nodes (iteratively:
  nesting is counted as it goes and refused beyond ``MAX_DEPTH``, never a recursion),
  and the values are built here, from the plain YAML 1.2 core types — str, int, float,
  bool, null, timestamp, seq, map and the ``<<`` merge key. Any other tag (``!!binary``,
  ``!!python/...``, ``!!set``, ``!custom``) and any scalar its tag cannot hold
  (``!!int abc``, ``2026-13-01``) is a ``Problem`` at the node's ``file:line:col``,
  never an exception.

Events come from one parser for every file, whatever its size: libyaml (the C parser,
through PyYAML, a dependency), so a file reads, and fails with a diagnostic, the same
way at 1 KB and at 40 MB. Its events come thirty times as fast as ruamel's pure
parser's, and 100 000 users (3.8 MB) are composed and converted in 2 s of one core. Where
libyaml cannot be had (a PyYAML built without it) or cannot read the text (a lone
surrogate in an override's text: libyaml reads UTF-8 only), ruamel's pure parser gives
the events instead, composed by the same code into the same nodes. The two scanners
differ in corners, and libyaml's reading is the one that holds: it takes a tab as white
space where YAML allows one (ruamel refuses any tab outside quotes, block scalars,
comments and flow collections; both refuse tabs in indentation), counts NEL, LS and PS
as line breaks, reads a BOM inside the text, an anchor name ending in ``:`` and tags
such as ``!!!int`` its own way, refuses a few things ruamel reads (``: x`` with no key,
``[:7]``), and words its errors (and sometimes places them) differently. The bounds (depth, nodes, bytes) are the composer's and the
converter's, the same for both. Where the two agree on the text, the composer makes them
agree on the nodes: plain scalars are resolved by ruamel's own YAML 1.2 rule table (1.1
under a ``%YAML 1.1`` directive), so ``yes``, ``on``, ``0o17`` and ``1:30`` mean what
they always meant here, and libyaml's empty values are placed where ruamel places them
(``_Marks``).

Memory: a node's start mark is the ``Pos`` the source map keeps, the converter lets each
item's nodes go once converted, and the cyclic collector waits while a file is composed
and converted (``reconciler.gcpause``). A million users (39 MB) load, validated, in 2.2 GB at the
peak.

Limits, and why: a cluster of a million users is about 38 MB of YAML and 10 million
nodes composed and converted (each user five, counted twice), so one file may be
``MAX_FILE_BYTES`` = 64 MiB and the file and its includes together
``MAX_TOTAL_BYTES`` = 128 MiB. The node budget grows with the text actually read:
``MAX_NODES`` = 60 000 plus one node per byte. Honest YAML spends well under one node
per byte (a user line spends one per four), a flood of the densest text (``a,`` in a
flow list) at most one, while an alias bomb expands far beyond its bytes and is
refused as before — within 60 000 nodes for a small file.
"""

from __future__ import annotations

import datetime as dt
import errno
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ruamel.yaml import YAML
from ruamel.yaml import events as ruamel_events
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from ruamel.yaml.resolver import VersionedResolver
from ruamel.yaml.tag import Tag

from reconciler import gcpause
from reconciler.config.diagnostics import Diagnostic, Path, Pos, SourceMap, at, unknown_key, wrong_kind
from reconciler.errors import Problem
from reconciler.safe_read import read_regular_file

try:  # libyaml's event parser, through PyYAML (no type stubs are installed for it: its objects are Any here)
    import yaml as pyyaml  # type: ignore[import-untyped]

    _C_LOADER: Any = pyyaml.CSafeLoader if pyyaml.__with_libyaml__ else None
except ImportError:  # pragma: no cover — PyYAML is a dependency; without it (or its libyaml) ruamel reads every file
    pyyaml = None
    _C_LOADER = None

#: Nodes (after alias expansion) the cluster file and all its includes may hold together,
#: besides ``NODES_PER_BYTE`` for every byte read: ``Budget`` grows as files are read.
MAX_NODES = 60_000
#: Nodes the budget grows by for each byte read (see the module's docstring).
NODES_PER_BYTE = 1
#: Bytes of one file, checked before parsing starts.
MAX_FILE_BYTES = 64 * 1024 * 1024
#: Bytes of the cluster file and all its includes together.
MAX_TOTAL_BYTES = 128 * 1024 * 1024
#: Nesting depth of collections; a cluster file needs about 8.
MAX_DEPTH = 64
#: Items of a list of records (``TopLevel.records``) that are not mappings, past which the composer stops the file:
#: fewer are the loader's to tell (the first of them, and how many), more would be millions of nodes to tell it.
MAX_NOT_RECORDS = 10_000

#: Seconds a load may take for each MB of YAML it may read, besides the caller's base (``load_seconds``):
#: a million users (39 MB) take about 30 s of one core here, parsed, converted and validated.
LOAD_SECONDS_PER_MB = 2.0
#: Entries of the cluster's folder tree ``load_seconds`` looks at (a time budget's guess, so bounded).
SIZE_WALK_ENTRIES = 20_000

_TAG = "tag:yaml.org,2002:"
_INT = re.compile(r"^[-+]?(0|[1-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+|0b[01_]+|[0-9][0-9_]*)$")
_TIMESTAMP = re.compile(
    r"^(?P<year>[0-9]{4})-(?P<month>[0-9]{1,2})-(?P<day>[0-9]{1,2})"
    r"(?:(?:[Tt]|[ \t]+)(?P<hour>[0-9]{1,2}):(?P<minute>[0-9]{2}):(?P<second>[0-9]{2})"
    r"(?:\.(?P<fraction>[0-9]*))?"
    r"(?:[ \t]*(?P<tz>Z|(?P<tz_sign>[-+])(?P<tz_hour>[0-9]{1,2})(?::?(?P<tz_minute>[0-9]{2}))?))?)?$"
)
_BOOLS = {"true": True, "false": False}
_SEQ, _MAP, _MERGE = _TAG + "seq", _TAG + "map", _TAG + "merge"
#: The core tags a scalar may carry → the kind ``_Converter.scalar`` makes of it; any other tag is refused.
_KIND = {_TAG + kind: kind for kind in ("str", "null", "bool", "int", "float", "timestamp")}


class _TooLarge(Exception):
    """The budget ran out: at ``where`` while composing, or (None) while the converter expanded aliases."""

    def __init__(self, where: Pos | None = None):
        super().__init__()
        self.where = where


@dataclass(frozen=True)
class TopLevel:
    """What the schema lets a file's top-level mapping hold: ``keys`` → ``"list"``, ``"mapping"`` or None (anything);
    ``closed``: no other key. The composer checks each top-level key as it is read and each value as it starts."""

    keys: Mapping[str, Literal["list", "mapping"] | None]
    closed: bool = True
    records: frozenset[str] = frozenset()  # keys whose list holds mappings only (servers, users): see MAX_NOT_RECORDS


@dataclass
class Budget:
    """Nodes and bytes left for the cluster file and its includes together.

    ``allowed`` is what the nodes started from: ``MAX_NODES`` plus ``NODES_PER_BYTE``
    for every byte read so far.
    """

    nodes: int = MAX_NODES
    bytes: int = MAX_TOTAL_BYTES
    allowed: int = MAX_NODES

    def spend(self) -> None:
        self.nodes -= 1
        if self.nodes < 0:
            raise _TooLarge

    def read(self, n: int, display: str) -> None:
        self.bytes -= n
        if self.bytes < 0:
            raise Problem(Diagnostic("error", f"the cluster file and its includes are more than {MAX_TOTAL_BYTES} bytes together",
                                     "keep the cluster smaller; move what is not cluster state out of it", file=display, code="size"))
        self.nodes += n * NODES_PER_BYTE
        self.allowed += n * NODES_PER_BYTE


def _too_large(display: str, budget: Budget, where: Pos | None = None) -> Problem:
    """The budget's refusal: at the node where it ran out while composing, else (aliases expanded) at the top."""
    return Problem(at(
        "error", where or Pos(display, 1, 1),
        f"the cluster expands to more than {budget.allowed} values (this file and its includes together)",
        "anchors and aliases multiply content; write the data out, or split the cluster", "size"))


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
    raw = file_bytes(lambda: read_regular_file(path, MAX_FILE_BYTES), display)
    budget.read(len(raw), display)
    return decoded(raw, display)


def file_bytes(read: Callable[[], bytes], display: str) -> bytes:
    """What ``read`` gives, or ``Problem`` saying why a file cannot be had (the one wording for every reader)."""
    try:
        return read()
    except FileNotFoundError:
        raise Problem(Diagnostic("error", "file not found", "check the path", file=display, code="file")) from None
    except IsADirectoryError:
        raise Problem(Diagnostic("error", "is a directory, not a file", file=display, code="file")) from None
    except OSError as exc:
        hint = "split it with includes" if exc.errno == errno.EFBIG else None
        raise Problem(Diagnostic("error", f"cannot read: {exc.strerror}", hint, file=display, code="file")) from None
    except ValueError as exc:  # e.g. an embedded NUL in a path
        raise Problem(Diagnostic("error", f"cannot read: {exc}", file=display, code="file")) from None


def decoded(raw: bytes, display: str) -> str:
    """A file's bytes as text (UTF-8, a BOM dropped), or ``Problem`` at the line that is not."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise Problem(Diagnostic("error", "not UTF-8 text", "save the file as UTF-8", display, line, 1, "encoding")) from None


def load_seconds(path: str, base: float) -> float:
    """How long loading the cluster at ``path`` may take: ``base`` and ``LOAD_SECONDS_PER_MB`` for each MB of it.

    The MB are the file's and those of the YAML files in its folder tree, where its
    includes are (hidden folders skipped, at most ``SIZE_WALK_ENTRIES`` entries looked
    at; ``include_roots`` elsewhere are not counted). A bound on how long to wait for a
    load, not on the load itself: ``Budget`` bounds that.
    """
    main = os.path.abspath(path)
    total = 0
    try:
        total = os.path.getsize(main)
    except OSError:
        pass
    seen = 0
    for root, dirs, files in os.walk(os.path.dirname(main)):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        seen += len(dirs) + len(files)
        for name in files:
            full = os.path.join(root, name)
            if name.endswith((".yaml", ".yml")) and full != main:
                try:
                    total += os.path.getsize(full)
                except OSError:
                    pass
        if seen > SIZE_WALK_ENTRIES:
            break
    return base + LOAD_SECONDS_PER_MB * total / 1e6


def read_yaml(path: str, display: str, overrides: dict[str, str] | None = None,
              budget: Budget | None = None, *, top: TopLevel | None = None) -> tuple[Any, SourceMap]:
    """Parse one file into plain data and its source map; ``Problem`` on any failure.

    ``overrides`` maps absolute paths to text standing in for the file (an edit being
    validated before it is written). ``budget`` is shared by a cluster's files. ``top``:
    what the schema lets the top level hold (the file stops at the first thing it cannot).
    """
    budget = budget or Budget()
    text = read_text(path, display, overrides, budget)
    return parse_yaml(text, display, budget, top=top)


def parse_yaml(text: str, display: str, budget: Budget, *, parser: str | None = None,
               top: TopLevel | None = None) -> tuple[Any, SourceMap]:
    """``text`` → plain data and its source map, paid from ``budget``; ``Problem`` on any failure.

    ``parser``: ``"ruamel"`` or ``"libyaml"`` for the events; by default libyaml (``compose_yaml``). ``top``: as for ``compose_yaml``.
    """
    with gcpause.paused():  # composing a million users makes ~20 million objects that all live on
        node = compose_yaml(text, display, budget, parser=parser, top=top)
        source = SourceMap(root=Pos(display, 1, 1))
        if node is None:
            return None, source
        try:
            return _Converter(display, source, budget, consume=True).value(node, ()), source
        except _TooLarge:
            raise _too_large(display, budget) from None
        except RecursionError:  # aliases nest expansions past Python's stack: each alias adds up to MAX_DEPTH levels
            raise Problem(Diagnostic("error", "nesting is too deep", file=display, line=1, col=1, code="yaml")) from None


def compose_yaml(text: str, display: str, budget: Budget, *, parser: str | None = None,
                 top: TopLevel | None = None) -> Node | None:
    """The document's root node (None for an empty stream), every node paid from ``budget``; ``Problem`` on failure.

    Every text is parsed by libyaml (ruamel's pure parser where libyaml is missing, or for a
    text with a lone surrogate; ``parser`` forces either). The nodes' start
    marks are the ``Pos`` each will have in the source map (``display``, 1-based).
    ``top``: the composer stops at the first top-level key or value it does not allow.
    """
    if parser is None:
        parser = "libyaml" if _C_LOADER is not None else "ruamel"
    if parser == "libyaml":
        if _C_LOADER is None:
            raise ValueError("libyaml is not available")
        try:
            return _compose(_c_events(text), display, budget, text, top)
        except _TooLarge as exc:
            raise _too_large(display, budget, exc.where) from None
        except (pyyaml.YAMLError, _Refused) as exc:
            raise Problem(_error(exc, text, display)) from None
        except UnicodeEncodeError:  # a lone surrogate (in an override's text): libyaml reads UTF-8 only, ruamel reads it
            pass  # nothing was spent: the text is encoded before the first event
    try:
        return _compose(_pure_events(text), display, budget, top=top)
    except _TooLarge as exc:
        raise _too_large(display, budget, exc.where) from None
    except (MarkedYAMLError, YAMLError, _Refused) as exc:
        raise Problem(_error(exc, text, display)) from None
    except AssertionError as exc:  # ruamel asserts a %YAML directive's minor version is 1 or 2 (libyaml refuses it)
        if "version minor part" not in str(exc):
            raise
        directive = re.search(r"^%YAML", text, re.M)
        line = text.count("\n", 0, directive.start()) + 1 if directive else 1
        raise Problem(Diagnostic("error", "YAML syntax: found incompatible YAML document (version 1.1 or 1.2 is required)",
                                 "write %YAML 1.2, or leave the directive out", display, line, 1, "yaml")) from None




def _error(exc: Exception, text: str, display: str) -> Diagnostic:
    if isinstance(exc, _Refused) or hasattr(exc, "problem_mark"):
        return yaml_error(exc, text, display)  # type: ignore[arg-type]  # a marked error of either library or ours
    return Diagnostic("error", f"YAML error: {str(exc)[:200]}", file=display, line=1, col=1, code="yaml")


class _Mark(Protocol):
    line: int
    column: int


class _Marked(Protocol):
    """A parser error with marks: ruamel's and PyYAML's ``MarkedYAMLError``, and ``_Refused``."""

    context: str | None
    context_mark: _Mark | None
    problem: str | None
    problem_mark: _Mark | None


class _Refused(Exception):
    """The composer's own refusal (undefined alias, a second document, nesting too deep), marked as the parsers' errors are."""

    def __init__(self, context: str | None, context_mark: Any, problem: str, problem_mark: Any):
        super().__init__(problem)
        self.context = context
        self.context_mark = context_mark
        self.problem = problem
        self.problem_mark = problem_mark


def yaml_error(exc: _Marked, text: str, display: str) -> Diagnostic:
    """A parser error as a diagnostic at its mark, with a hint for the common slips."""
    mark = exc.problem_mark or exc.context_mark
    line = (mark.line + 1) if mark else 1
    col = (mark.column + 1) if mark else 1
    problem = (exc.problem or exc.context or "invalid YAML").strip()
    offending = _line(text, line)
    code = "yaml"
    if "\t" in offending or "'\\t'" in problem:
        code = "tab"
        col = (offending.index("\t") + 1) if "\t" in offending else col
        problem = "tab character in indentation"
        hint = "YAML indents with spaces only; replace the tab with spaces"
    elif "maximum depth" in problem or "maximum nesting depth" in problem:  # ruamel's and ours, libyaml's (past 1000)
        problem = f"nesting is deeper than {MAX_DEPTH} levels"
        hint = "a cluster file needs a handful of levels; check the brackets"
    elif "mapping values are not allowed" in problem:
        hint = "a ':' inside a value needs quotes, or the indentation is off"
    elif any(s in problem for s in ("expected <block end>", "could not find expected ':'", "did not find expected key",
                                    "did not find expected '-' indicator")):  # the last two: libyaml's wording
        hint = "check the indentation of this line against the lines above"
    else:
        hint = "fix the YAML syntax at this position"
    return Diagnostic("error", f"YAML syntax: {problem[:200]}", hint, display, line, col, code)


def _line(text: str, line: int) -> str:
    """Line ``line`` (1-based) of ``text`` as ``str.splitlines`` counts lines, without splitting all of a large text."""
    if line < 1:
        return ""
    start = 0
    for _ in range(line - 1):  # libyaml's line breaks (\r, \n, \r\n) are the ones a file is counted by
        nl = text.find("\n", start)
        if nl < 0:
            return ""
        start = nl + 1
    end = text.find("\n", start)
    return text[start:end if end >= 0 else len(text)].rstrip("\r")


# --------------------------------------------------------------------------- events → nodes

# Event kinds, for both parsers' event classes.
_SCALAR, _SEQUENCE, _MAPPING, _ALIAS, _END, _DOCUMENT, _DOCUMENT_END, _STREAM, _STREAM_END = range(9)
_KINDS: dict[type, int] = {
    ruamel_events.ScalarEvent: _SCALAR, ruamel_events.SequenceStartEvent: _SEQUENCE,
    ruamel_events.MappingStartEvent: _MAPPING, ruamel_events.AliasEvent: _ALIAS,
    ruamel_events.SequenceEndEvent: _END, ruamel_events.MappingEndEvent: _END,
    ruamel_events.DocumentStartEvent: _DOCUMENT, ruamel_events.DocumentEndEvent: _DOCUMENT_END,
    ruamel_events.StreamStartEvent: _STREAM, ruamel_events.StreamEndEvent: _STREAM_END,
}
if pyyaml is not None:
    _KINDS.update({
        pyyaml.ScalarEvent: _SCALAR, pyyaml.SequenceStartEvent: _SEQUENCE, pyyaml.MappingStartEvent: _MAPPING,
        pyyaml.AliasEvent: _ALIAS, pyyaml.SequenceEndEvent: _END, pyyaml.MappingEndEvent: _END,
        pyyaml.DocumentStartEvent: _DOCUMENT, pyyaml.DocumentEndEvent: _DOCUMENT_END,
        pyyaml.StreamStartEvent: _STREAM, pyyaml.StreamEndEvent: _STREAM_END,
    })


def _c_events(text: str) -> Iterator[Any]:
    parser = _C_LOADER(text)
    try:
        get = parser.get_event
        end = pyyaml.StreamEndEvent
        while True:
            event = get()
            yield event
            if event.__class__ is end:
                return
    finally:
        parser.dispose()


def _pure_events(text: str) -> Iterator[Any]:
    yield from YAML(typ="safe", pure=True).parse(text)


class _FixedTag(Tag):
    """A ruamel ``Tag`` that is exactly the given tag, already resolved (libyaml decodes ``%xx`` itself)."""

    def __init__(self, tag: str):
        super().__init__(suffix=tag)
        self._trval = self.text = tag


def _tag_text(node: Node) -> str | None:
    """``node.tag``, without three calls through ruamel's ``Tag`` for the composer's own tags."""
    tag = node.ctag
    return tag.text if tag.__class__ is _FixedTag else node.tag


_TAGS: dict[str, Tag] = {}


def _tag(tag: str) -> Tag:
    """One shared ``Tag`` per tag: a node holds a reference, not an object of its own."""
    found = _TAGS.get(tag)
    if found is None:
        if len(_TAGS) > 1000:  # tags are the file's to choose: bound what they keep alive
            _TAGS.clear()
        found = _TAGS[tag] = _FixedTag(tag)
    return found


_RULES: dict[tuple[int, int], Callable[[str], Tag]] = {}


def _resolver(version: tuple[int, int] | None) -> Callable[[str], Tag]:
    """Plain scalar → its implicit tag, by ruamel's rule table for ``version`` (YAML 1.2 unless a directive says 1.1)."""
    version = (1, 1) if version == (1, 1) else (1, 2)  # both parsers refuse any other %YAML directive
    found = _RULES.get(version)
    if found is not None:
        return found
    table: dict[Any, list[tuple[str, Any]]] = VersionedResolver(version=version).versioned_resolver
    anywhere = list(table.get(None, []))
    rules = {first: [(_tag(tag), regexp.match) for tag, regexp in [*resolvers, *anywhere]]
             for first, resolvers in table.items() if first is not None}
    default = [(_tag(tag), regexp.match) for tag, regexp in anywhere]
    plain_str = _tag(_TAG + "str")

    def resolve(value: str) -> Tag:
        for tag, match in rules.get(value[:1], default):
            if match(value):
                return tag
        return plain_str

    _RULES[version] = resolve
    return resolve


def _compose(events: Iterable[Any], display: str, budget: Budget, text: str | None = None,
             top: TopLevel | None = None) -> Node | None:
    """One document's events → its root node, as ruamel's ``Composer.get_single_node`` builds it, without recursion.

    Every node (an alias too) is paid from ``budget`` as it is composed; a node nested
    deeper than ``MAX_DEPTH`` (a scalar counts as a level, as in ruamel) is refused at
    its start. An anchor names the node object itself: an alias returns the same node
    (its expansion is paid by ``_Converter``), and a collection's anchor is known while
    its items are composed (an alias inside it is a cycle, refused by ``_Converter``).
    A node's start mark is its ``Pos`` (made once, kept by the source map); no end marks
    are kept: nothing reads them, and a million users would keep five million.

    ``text``: the events are libyaml's, for this text. libyaml starts some empty values
    (``key:`` with nothing after it) and nodes with a tag before their anchor elsewhere
    than ruamel, and gives ``!`` on an empty node another meaning; those are put as
    ruamel has them (``_Marks``), so both parsers' events compose to the same nodes.

    ``top``: each key of a top-level mapping is checked as soon as it is composed, each of
    its values as soon as it starts (``_top_key``, ``_top_value``): what the schema cannot
    hold stops the file there, before anything under it is composed.

    The loop here makes what there are millions of (a plain scalar; an item, key or value
    put in its place) without a call; what comes once per construct (a list or mapping
    starting, an alias, a tag or an anchor, libyaml's empty values, the stream's framing)
    is ``_Document``'s.
    """
    kinds = _KINDS
    new_scalar = ScalarNode.__new__
    events = iter(events)
    doc = _Document(display, top, _Marks(text) if text is not None else None)
    empties, str_tag = doc.empties, doc.str_tag
    parents, keys = doc.parents, doc.keys
    key_end: Any = None  # where the last key ended (libyaml's mark: an empty value of a flow mapping is placed by it)
    waiting: Any = None  # an empty block mapping value: ruamel places it where the next token ends
    root_mark = None
    last_line = 0
    left = budget.nodes
    node: Any
    try:
        resolve = doc.begin(events)
        for event in events:
            kind = kinds[event.__class__]
            if waiting is not None:
                waiting.start_mark = empties.after_empty_value(event.start_mark, display)  # type: ignore[union-attr]
                waiting = None
            if kind <= _ALIAS:
                left -= 1
                if kind == _ALIAS:
                    node = doc.alias(event, left)
                else:
                    mark = event.start_mark
                    if left < 0 or len(parents) > MAX_DEPTH:  # (``parents`` holds the document's own list too)
                        raise doc.refused(left, mark)
                    if root_mark is None:
                        root_mark = mark
                    line = mark.line + 1
                    if line == last_line:  # the nodes of one line share its number (a million users: 130 MB)
                        line = last_line
                    else:
                        last_line = line
                    if kind != _SCALAR:
                        doc.collection(event, kind, mark, line)
                        continue
                    tag, anchor, value = event.tag, event.anchor, event.value
                    node = new_scalar(ScalarNode)  # the slots ScalarNode.__init__ sets, without its checks
                    if tag is None and anchor is None and (value or empties is None or event.style):
                        ctag = resolve(value) if event.implicit[0] else str_tag  # plain, or quoted: text
                        pos = Pos(display, line, mark.column + 1)
                    else:  # a tag, an anchor, or an empty value from libyaml
                        ctag, pos, waiting = doc.scalar(node, event, line, key_end)
                    node.ctag, node.value, node.start_mark, node.end_mark = ctag, value, pos, None
                    node.comment, node.anchor, node.style = None, anchor, event.style
            elif kind == _END:
                node = parents.pop()
                keys.pop()
            else:  # the document's end
                break
            # ``node`` is complete: it is the root (the item of the document's list), an item, a key, or the value of
            # the waiting key.
            parent = parents[-1]
            if parent.__class__ is SequenceNode:
                if parent is doc.records and node.__class__ is not MappingNode:
                    doc.wrong.add(node, len(parent.value))
                parent.value.append(node)
            elif keys[-1] is None:
                keys[-1] = node
                key_end = event.end_mark  # read only for the key that waits for its value, in a flow mapping
                if parent is doc.mapping and top is not None:
                    _top_key(node, top, display, budget)
            else:
                parent.value.append((keys[-1], node))
                keys[-1] = None
        root = doc.end(events, root_mark)
    finally:
        budget.nodes = left
    return root


class _Document:
    """The document ``_compose`` composes: its state, and what its loop does once per construct.

    ``parents`` starts with a list of the document's own, whose one item is its root: every
    node composed has a parent.
    """

    __slots__ = ("display", "top", "empties", "resolve", "seq_tag", "map_tag", "str_tag", "anchors", "parents", "keys",
                 "mapping", "records", "wrong")

    def __init__(self, display: str, top: TopLevel | None, empties: _Marks | None):
        self.display = display
        self.top = top
        self.empties = empties
        self.seq_tag, self.map_tag, self.str_tag = _tag(_SEQ), _tag(_MAP), _tag(_TAG + "str")
        self.resolve = _resolver(None)
        self.anchors: dict[Any, Node] = {}
        self.parents: list[Any] = [SequenceNode(self.seq_tag, [], None, None)]  # the collections being composed, innermost last
        self.keys: list[Any] = [None]  # for each of them: the key waiting for its value (a mapping's), else None
        self.mapping: Any = None  # the top-level mapping, when ``top`` says what it may hold
        self.records: Any = None  # the list of records being composed (``top.records``) ...
        self.wrong: Any = None  # ... and its items that are not mappings (``_NotRecords``)

    def begin(self, events: Iterator[Any]) -> Callable[[str], Tag]:
        """Read the stream up to the document's start: the resolver of plain scalars for its ``%YAML`` version."""
        for event in events:
            if _KINDS[event.__class__] == _DOCUMENT:
                self.resolve = _resolver(event.version)
                break
        return self.resolve

    def end(self, events: Iterator[Any], root_mark: Any) -> Node | None:
        """Read the stream after the document, refusing a second one (as ``get_single_node`` does, ``root_mark`` the
        first one's start): the root node, None for a stream without a document."""
        for event in events:
            if _KINDS[event.__class__] == _DOCUMENT:
                raise _Refused("expected a single document in the stream", root_mark,
                               "but found another document", event.start_mark)
        document = self.parents[0].value
        return document[0] if document else None

    def refused(self, left: int, mark: Any) -> Exception:
        """Why a node starting at ``mark`` is refused: the budget ran out (``left`` below 0), else it nests too deep (its
        depth, counted as ruamel counts it, is the number of ``parents``: they hold the document's list too)."""
        if left < 0:
            return _TooLarge(Pos(self.display, mark.line + 1, mark.column + 1))
        return _Refused(None, None, f"maximum depth of data structure exceeded ({len(self.parents)}), "
                                    "if necessary increase YAML().max_depth", mark)

    def alias(self, event: Any, left: int) -> Node:
        """The node an alias names, the alias paid (``left``): the node itself, its expansion is ``_Converter``'s to pay."""
        if left < 0:
            raise self.refused(left, event.start_mark)
        node = self.anchors.get(event.anchor)
        if node is None:
            raise _Refused(None, None, f"found undefined alias {event.anchor!r}", event.start_mark)
        return node

    def collection(self, event: Any, kind: int, mark: Any, line: int) -> None:
        """A list or mapping starts (at ``mark``, on ``line``): its node is the innermost parent until its end. As the value
        of a top-level key, ``top`` checks its kind before any item of it is composed."""
        tag, anchor, empties = event.tag, event.anchor, self.empties
        ctag = (self.seq_tag if kind == _SEQUENCE else self.map_tag) if tag is None or tag == "!" else _tag(tag)
        if empties is not None and tag is not None and anchor is not None:
            pos = empties.tag_then_anchor(mark, self.display)
        else:
            pos = Pos(self.display, line, mark.column + 1)
        node = (SequenceNode if kind == _SEQUENCE else MappingNode)(ctag, [], pos, None, flow_style=event.flow_style, anchor=anchor)
        top, parent, key = self.top, self.parents[-1], self.keys[-1]
        if top is not None and parent is self.mapping and key is not None:
            if _top_value(key, kind == _SEQUENCE, pos, top):
                self.records, self.wrong = node, _NotRecords(key.value)
        if top is not None and len(self.parents) == 1 and kind == _MAPPING:
            self.mapping = node
        if anchor is not None:
            self.anchors[anchor] = node
        self.parents.append(node)
        self.keys.append(None)

    def scalar(self, node: ScalarNode, event: Any, line: int, key_end: Any) -> tuple[Tag, Pos, ScalarNode | None]:
        """The tag and position of a scalar with a tag or an anchor, or of an empty one from libyaml (``_compose`` makes
        the others), and ``node`` when its position waits for the next event (an empty block mapping value); an anchor
        names ``node`` (a later anchor of the same name replaces it, as in ruamel)."""
        tag, anchor, value, mark, display, empties = event.tag, event.anchor, event.value, event.start_mark, self.display, self.empties
        if tag is None or tag == "!":  # ruamel resolves a value tagged `!` as if plain, an empty one too
            ctag = self.resolve(value) if event.implicit[0] or tag else self.str_tag
        else:
            ctag = _tag(tag)
        if anchor is not None:
            self.anchors[anchor] = node
        if empties is not None and tag is not None and anchor is not None:
            return ctag, empties.tag_then_anchor(mark, display), None
        if value or empties is None or tag is not None or anchor is not None or event.style:
            return ctag, Pos(display, line, mark.column + 1), None
        parent, key = self.parents[-1], self.keys[-1]  # an empty node, from libyaml
        if parent.__class__ is not MappingNode:
            return ctag, empties.at(mark, display), None
        if parent.flow_style:
            return ctag, empties.in_flow_mapping(mark, key_end if key is not None else None, display), None
        pos = empties.at(mark, display)
        return ctag, pos, node if key is not None and empties.after_indicator(mark) else None


def _top_key(node: Node, top: TopLevel, display: str, budget: Budget) -> None:
    """A key of the top-level mapping, just composed: ``Problem`` when the schema has no such key (``top.closed``)."""
    if not top.closed or node.__class__ is not ScalarNode or _tag_text(node) == _MERGE:
        return  # a list or mapping as a key is the converter's to refuse; a merge's keys are the schema's
    key = _Converter(display, SourceMap(), budget).key(node)  # the key as the data will have it
    if key not in top.keys:
        raise Problem(unknown_key(node.start_mark, key, list(top.keys)))


def _top_value(key: Node, sequence: bool, pos: Pos, top: TopLevel) -> bool:
    """A list or mapping starting at ``pos`` as the value of the top-level ``key``: ``Problem`` when the schema holds
    the other kind there; whether it is a list of records (``top.records``)."""
    name = key.value if key.__class__ is ScalarNode else None
    want = top.keys.get(name) if isinstance(name, str) else None
    got: Literal["list", "mapping"] = "list" if sequence else "mapping"
    if want is not None and want != got:
        raise Problem(wrong_kind(pos, str(name), want, f"a {got}"))
    return sequence and name in top.records


_DESCRIBED = {_TAG + "str": "text", _TAG + "int": "a number", _TAG + "float": "a number", _TAG + "bool": "true/false",
              _TAG + "null": "nothing (null)", _TAG + "timestamp": "a date"}


class _NotRecords:
    """The items of one list of records that are not mappings: past ``MAX_NOT_RECORDS`` of them, ``Problem`` at the
    first (what the loader would have told, without composing the rest)."""

    def __init__(self, key: str):
        self.key = key
        self.count = 0
        self.first: tuple[int, Node] | None = None

    def add(self, node: Node, index: int) -> None:
        self.count += 1
        if self.first is None:
            self.first = (index, node)
        if self.count > MAX_NOT_RECORDS:
            first, item = self.first
            got = "a list" if item.__class__ is SequenceNode else _DESCRIBED.get(_tag_text(item) or "", "not a mapping")
            raise Problem(at("error", item.start_mark, f"{self.key}[{first}] must be a mapping, not {got}, and so are more "
                             f"than {MAX_NOT_RECORDS} other {self.key} after it: the file was read no further",
                             f"each of {self.key} is a mapping, e.g. `- name: alice`", "many"))


_BREAKS = "\n\r\x85\u2028\u2029"


class _Marks:
    """Where ruamel's parser starts a node that libyaml starts elsewhere, from libyaml's marks and the text.

    The parsers agree on every node's start but these:

    - an empty value of a block mapping: libyaml puts it just after the ``:``, ruamel
      where the next token ends — the next key (or the end of the mapping), often on a
      later line, and just after the ``?`` of an explicit key;
    - an empty value of a flow mapping: libyaml puts it where the next token starts
      (the ``,`` or ``}``), ruamel just after the ``:``; an empty key of a flow mapping:
      libyaml at the ``:``, ruamel just after the ``?``;
    - at the end of a text without a final line break, libyaml counts one more line;
    - a node with a tag and then an anchor (``!!str &a x``): ruamel starts it at the anchor.
    """

    def __init__(self, text: str):
        self.text = text
        self.eof: tuple[int, int] | None = None  # ruamel's (line, column) at the end, once needed

    def at(self, mark: Any, display: str, line: int | None = None, column: int | None = None) -> Pos:
        line = mark.line if line is None else line
        column = mark.column if column is None else column
        text = self.text
        if mark.index >= len(text) and text and text[-1] not in _BREAKS:
            if self.eof is None:
                start = max(text.rfind(b) for b in _BREAKS) + 1
                self.eof = (line - 1 if column == 0 else line, len(text) - start)
            line, column = self.eof
        return Pos(display, line + 1, column + 1)

    def tag_then_anchor(self, mark: Any, display: str) -> Pos:
        """Ruamel's start of a node with both a tag and an anchor: the anchor's, when the tag comes first."""
        text, index = self.text, mark.index
        if text[index:index + 1] != "!":
            return self.at(mark, display)
        end = index
        while end < len(text) and text[end] not in " \t\n\r\x85\u2028\u2029":
            end += 1
        anchor = end
        while anchor < len(text) and text[anchor] in " \t":
            anchor += 1
        if text[anchor:anchor + 1] != "&":  # on another line (or not there): left as libyaml has it
            return self.at(mark, display)
        return self.at(mark, display, column=mark.column + anchor - index)

    def after_indicator(self, mark: Any) -> bool:
        """Whether libyaml's mark of an empty block mapping value is just after its ``:`` (not a key without one)."""
        return mark.index > 0 and self.text[mark.index - 1] == ":"

    def after_empty_value(self, mark: Any, display: str) -> Pos:
        """Ruamel's mark of an empty block mapping value, from the start of the next event (``mark``)."""
        text, index = self.text, mark.index
        back = index
        while back > 0 and text[back - 1] == " ":
            back -= 1
        if back < index and text[back - 1:back] == "?" and (back < 2 or text[back - 2] in " \n\r\x85\u2028\u2029-"):
            return self.at(mark, display, column=mark.column - (index - back))  # the next key is explicit: after its '?'
        return self.at(mark, display)

    def in_flow_mapping(self, mark: Any, key_end: Any, display: str) -> Pos:
        """Ruamel's mark of an empty value (after the key that ended at ``key_end``) or empty key (None) of a flow mapping."""
        text, index = self.text, mark.index
        if key_end is not None:  # just after the ':' that follows the key on its line
            colon = key_end.index
            while colon < index and text[colon] == " ":
                colon += 1
            if colon < index and text[colon] == ":":
                return self.at(key_end, display, key_end.line, key_end.column + colon + 1 - key_end.index)
            return self.at(mark, display)
        back = index
        while back > 0 and text[back - 1] == " ":
            back -= 1
        if text[back - 1:back] == "?":
            return self.at(mark, display, column=mark.column - (index - back))
        return self.at(mark, display)


class _Converter:
    """Composed nodes → plain data, positions into the source map, every node paid from the budget.

    It runs once per node of a cluster (ten million for a million users), so the hot paths
    read a node's tag through ``_tag_text`` and make a position only where one is kept.
    """

    def __init__(self, display: str, source: SourceMap, budget: Budget, consume: bool = False):
        self.display = display
        self.source = source
        self.budget = budget
        self.open: set[int] = set()  # collections being converted: an alias to one of them is a cycle
        # Let go of each item once converted, where nothing can reach it again (no anchor on or above it),
        # so the nodes are freed as the data grows: a million users' nodes and data need not be held at once.
        self.consume = consume
        self.shared = 0  # anchored nodes being converted (an alias may convert what is below them again)

    def pos(self, node: Node) -> Pos:
        mark = node.start_mark
        if mark.__class__ is Pos:  # the composer's nodes carry their position
            return mark
        return Pos(self.display, mark.line + 1, mark.column + 1)

    def fail(self, node: Node, message: str, hint: str | None, code: str = "yaml") -> Problem:
        return Problem(at("error", self.pos(node), message, hint, code))

    def value(self, node: Node, path: Path) -> Any:
        budget = self.budget
        budget.nodes -= 1
        if budget.nodes < 0:
            raise _TooLarge
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
        anchored = node.anchor is not None
        self.shared += anchored
        try:
            if isinstance(node, SequenceNode):
                self.expect(node, _SEQ)
                keys, values, pos, value = self.source.keys, self.source.values, self.pos, self.value
                consume = self.consume and not self.shared
                items = []
                seq = node.value
                for i, item in enumerate(seq):
                    child = path + (i,)
                    keys[child] = values[child] = pos(item)
                    items.append(value(item, child))
                    if consume:
                        seq[i] = None
                return items
            if isinstance(node, MappingNode):
                self.expect(node, _MAP)
                return self.mapping(node, path)
        finally:
            self.open.discard(id(node))
            self.shared -= anchored
        raise self.fail(node, "unexpected YAML node", None)  # pragma: no cover — the composer makes only these three

    def expect(self, node: Node, tag: str) -> None:
        found = _tag_text(node)
        if found != tag:
            raise self.fail(node, f"the YAML tag {_short(found)} is not accepted here", _TAG_HINT, "tag")

    def mapping(self, node: MappingNode, path: Path) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        explicit: dict[Any, Node] = {}
        merged: list[tuple[Any, Any, Pos | None, Pos | None]] = []
        keys, values, pos, budget = self.source.keys, self.source.values, self.pos, self.budget
        consume = self.consume and not self.shared
        pairs = node.value
        for index, (key_node, value_node) in enumerate(pairs):
            if consume:
                pairs[index] = None
            if _tag_text(key_node) == _MERGE:
                merged.extend(self.merge(value_node, path))
                continue
            if not isinstance(key_node, ScalarNode):
                raise self.fail(key_node, "a key must be text, not a list or mapping", "write the key as plain text", "type")
            budget.nodes -= 1
            if budget.nodes < 0:
                raise _TooLarge
            key = self.key(key_node)
            if key in explicit:
                first = explicit[key]
                raise self.fail(key_node, f"duplicate key {key!r} (first at line {self.pos(first).line})",
                                "each key may appear once in a mapping; remove or rename one of them", "duplicate-key")
            explicit[key] = key_node
            child = path + (key,)
            keys[child] = pos(key_node)
            values[child] = pos(value_node)
            out[key] = self.value(value_node, child)
        for key, value, kpos, vpos in merged:  # YAML merge: keys written out win over merged ones
            if key not in out:
                out[key] = value
                if kpos and vpos:
                    keys[path + (key,)] = kpos
                    values[path + (key,)] = vpos
        return out

    def merge(self, node: Node, path: Path) -> list[tuple[Any, Any, Pos | None, Pos | None]]:
        sources = node.value if isinstance(node, SequenceNode) else [node]
        pairs: list[tuple[Any, Any, Pos | None, Pos | None]] = []
        for src in sources:
            if not isinstance(src, MappingNode):
                raise self.fail(src, "`<<` merges a mapping (or a list of mappings) into this one",
                                "write `<<: *anchor` where the anchor names a mapping", "merge")
            scratch = SourceMap(root=self.source.root)
            sub = _Converter(self.display, scratch, self.budget, self.consume)
            sub.open, sub.shared = self.open, self.shared
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
        if value.__class__ is str:
            return sys.intern(value)  # a million users' "name" keys are one string, not a million
        if isinstance(value, bool) or value is None:
            return "null" if value is None else str(value).lower()
        if isinstance(value, (int, float, str)):
            return value
        return str(value)

    def scalar(self, node: ScalarNode) -> Any:
        tag = _tag_text(node) or ""
        text: str = node.value
        kind = _KIND.get(tag)
        if kind == "str":
            return _clean_text(text, node, self.pos)
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


def _clean_text(text: str, node: Node, pos_of: Callable[[Node], Pos]) -> str:
    """Join UTF-16 surrogate pairs written as escapes ("\\ud83c\\udde9"); refuse lone surrogates and NUL (at ``node``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            text = text.encode("utf-16", "surrogatepass").decode("utf-16")
        except UnicodeDecodeError:
            raise Problem(at("error", pos_of(node), "text contains an invalid \\u escape (a lone UTF-16 surrogate)",
                             "write the character itself, or a valid escape", "encoding")) from None
    if "\x00" in text:
        raise Problem(at("error", pos_of(node), "text contains a NUL character", "remove the \\0 escape", "encoding"))
    return text
