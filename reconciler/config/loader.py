"""Load ``cluster.yaml`` (and its includes) into a ``Cluster`` with positioned diagnostics.

``load_cluster(path)`` never raises for bad input: every problem — unreadable
file, YAML syntax, tabs, duplicate keys, wrong types, unknown keys, broken
references — comes back as a ``Diagnostic`` with ``file:line:col`` and a hint.
The cluster is returned only when there are no errors, so nothing downstream
ever sees a half-valid file.

Includes: the main file may list ``includes:`` (paths or globs, relative to
the main file). Each included file holds ``servers``, ``routes`` and/or
``users`` lists that are appended, in order, to the main file's; errors in an
included entry point into the included file.
"""

from __future__ import annotations

import datetime as dt
import difflib
import glob
import os
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from reconciler.config.diagnostics import Diagnostic, Path, Pos, SourceMap, at
from reconciler.config.semantic import check
from reconciler.model import Cluster

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails  # pydantic's own dependency: the type of ValidationError.errors()

#: Anchors and aliases can make a small file expand enormously ("billion laughs").
MAX_NODES = 200_000
MAX_FILE_BYTES = 16 * 1024 * 1024
INCLUDABLE = ("servers", "routes", "users")


class _TooLarge(Exception):
    pass


@dataclass
class LoadResult:
    """What loading produced: the cluster (only when valid) and every diagnostic."""

    path: str
    cluster: Cluster | None
    diagnostics: list[Diagnostic] = field(default_factory=list)
    source: SourceMap = field(default_factory=SourceMap)

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "warning"]

    @property
    def ok(self) -> bool:
        return self.cluster is not None and not self.errors


# --------------------------------------------------------------------------- YAML → plain data


def _read_bytes(path: str, display: str, overrides: dict[str, str] | None) -> bytes:
    override = (overrides or {}).get(os.path.abspath(path))
    if override is not None:
        return override.encode("utf-8")
    try:
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise _Problem(Diagnostic("error", f"file is {size} bytes, more than the {MAX_FILE_BYTES} allowed",
                                      "split it with includes", file=display, code="file"))
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        raise _Problem(Diagnostic("error", "file not found", "check the path", file=display, code="file")) from None
    except IsADirectoryError:
        raise _Problem(Diagnostic("error", "is a directory, not a file", file=display, code="file")) from None
    except OSError as exc:
        raise _Problem(Diagnostic("error", f"cannot read: {exc.strerror}", file=display, code="file")) from None
    except ValueError as exc:  # e.g. an embedded NUL in a path
        raise _Problem(Diagnostic("error", f"cannot read: {exc}", file=display, code="file")) from None


def _read_yaml(path: str, display: str, overrides: dict[str, str] | None = None) -> tuple[Any, SourceMap]:
    """Parse one file into plain Python data and its source map; raise _Problem on failure.

    ``overrides`` maps absolute paths to text that stands in for the file's content
    (an edit being validated before it is written).
    """
    raw = _read_bytes(path, display, overrides)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise _Problem(
            Diagnostic("error", "not UTF-8 text", "save the file as UTF-8", display, line, 1, "encoding")
        ) from None
    yaml = YAML(typ="rt")
    yaml.allow_duplicate_keys = False
    try:
        doc = yaml.load(text)
    except MarkedYAMLError as exc:
        raise _Problem(_yaml_error(exc, text, display)) from None
    except YAMLError as exc:
        raise _Problem(Diagnostic("error", f"YAML error: {exc}", file=display, line=1, col=1, code="yaml")) from None
    except RecursionError:
        raise _Problem(Diagnostic("error", "nesting is too deep", file=display, line=1, col=1, code="yaml")) from None
    source = SourceMap(root=Pos(display, 1, 1))
    counter = [0]
    try:
        data = _plain(doc, (), source, display, counter)
    except _TooLarge:
        raise _Problem(
            Diagnostic(
                "error",
                f"the document expands to more than {MAX_NODES} values",
                "anchors and aliases multiply content; write the data out or split it with includes",
                display, 1, 1, "yaml",
            )
        ) from None
    except RecursionError:
        raise _Problem(Diagnostic("error", "nesting is too deep", file=display, line=1, col=1, code="yaml")) from None
    return data, source


class _Problem(Exception):
    def __init__(self, diagnostic: Diagnostic):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


def _yaml_error(exc: MarkedYAMLError, text: str, display: str) -> Diagnostic:
    mark = exc.problem_mark or exc.context_mark
    line = (mark.line + 1) if mark else 1
    col = (mark.column + 1) if mark else 1
    problem = (exc.problem or exc.context or "invalid YAML").strip()
    lines = text.splitlines()
    offending = lines[line - 1] if 0 < line <= len(lines) else ""
    hint = None
    code = "yaml"
    if "duplicate key" in problem:
        code = "duplicate-key"
        first = exc.context_mark
        where = f" (first at line {first.line + 1})" if first else ""
        problem = problem.split(" with value")[0] + where
        hint = "each key may appear once in a mapping; remove or rename one of them"
    elif "\t" in offending or "'\\t'" in problem:
        code = "tab"
        col = (offending.index("\t") + 1) if "\t" in offending else col
        problem = "tab character in indentation"
        hint = "YAML indents with spaces only; replace the tab with spaces"
    elif "mapping values are not allowed" in problem:
        hint = "a ':' inside a value needs quotes, or the indentation is off"
    elif "expected <block end>" in problem or "could not find expected ':'" in problem:
        hint = "check the indentation of this line against the lines above"
    else:
        hint = "fix the YAML syntax at this position"
    return Diagnostic("error", f"YAML syntax: {problem}", hint, display, line, col, code)


def _plain(node: Any, path: Path, source: SourceMap, display: str, counter: list[int]) -> Any:
    """Convert ruamel's round-trip nodes into plain data, recording positions on the way."""
    counter[0] += 1
    if counter[0] > MAX_NODES:
        raise _TooLarge
    lc = getattr(node, "lc", None)
    if isinstance(node, dict):
        out: dict[Any, Any] = {}
        for key, value in node.items():
            k = _clean_text(str(key), source.root) if isinstance(key, str) else _scalar_key(key)
            child = path + (k,)
            if lc is not None:
                try:
                    kl, kc = lc.key(key)
                    source.keys[child] = Pos(display, kl + 1, kc + 1)
                    vl, vc = lc.value(key)
                    source.values[child] = Pos(display, vl + 1, vc + 1)
                except (KeyError, TypeError):
                    pass
            out[k] = _plain(value, child, source, display, counter)
        return out
    if isinstance(node, (list, tuple)):
        items = []
        for i, value in enumerate(node):
            child = path + (i,)
            if lc is not None:
                try:
                    il, ic = lc.item(i)
                    source.keys[child] = source.values[child] = Pos(display, il + 1, ic + 1)
                except (KeyError, TypeError):
                    pass
            items.append(_plain(value, child, source, display, counter))
        return items
    if isinstance(node, bool) or node is None:
        return node
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, str):
        return _clean_text(str(node), source.value(path) or source.root)
    if isinstance(node, (dt.date, dt.datetime)):
        return node
    return str(node)


def _clean_text(text: str, pos: Pos | None) -> str:
    """Join UTF-16 surrogate pairs written as escapes ("\\ud83c\\udde9"); refuse lone surrogates and NUL."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            text = text.encode("utf-16", "surrogatepass").decode("utf-16")
        except UnicodeDecodeError:
            raise _Problem(at("error", pos, "text contains an invalid \\u escape (a lone UTF-16 surrogate)",
                              "write the character itself, or a valid escape", "encoding")) from None
    if "\x00" in text:
        raise _Problem(at("error", pos, "text contains a NUL character", "remove the \\0 escape", "encoding"))
    return text


def _scalar_key(key: Any) -> Any:
    if isinstance(key, bool) or key is None:
        return str(key).lower() if key is not None else "null"
    if isinstance(key, (int, float)):
        return key
    return str(key)


# --------------------------------------------------------------------------- includes


def _merge_includes(
    data: dict[str, Any], main_path: str, display: str, source: SourceMap, overrides: dict[str, str] | None
) -> list[Diagnostic]:
    """Append the lists of every included file to ``data`` in place, remapping positions."""
    problems: list[Diagnostic] = []
    includes = data.get("includes")
    if includes is None:
        return problems
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        return [at("error", source.value(("includes",)), "includes must be a list of file paths",
                   "write e.g. `includes: [users.yaml, servers.d/*.yaml]`", "include")]
    base = os.path.dirname(os.path.abspath(main_path))
    display_base = os.path.dirname(display)
    seen: set[str] = {os.path.abspath(main_path)}
    for index, pattern in enumerate(includes):
        here = source.value(("includes", index))
        full = pattern if os.path.isabs(pattern) else os.path.join(base, pattern)
        matches = sorted(glob.glob(full)) if glob.has_magic(pattern) else [full]
        if not matches:
            problems.append(at("error", here, f"include {pattern!r} matches no file", "check the path or pattern", "include"))
        for match in matches:
            real = os.path.abspath(match)
            if real in seen:
                problems.append(at("error", here, f"{pattern!r} is included twice (or includes the main file)", None, "include"))
                continue
            seen.add(real)
            rel = os.path.relpath(match, base)
            shown = os.path.join(display_base, rel) if display_base else rel
            try:
                sub, sub_source = _read_yaml(match, shown, overrides)
            except _Problem as problem:
                d = problem.diagnostic
                problems.append(d if d.line else at("error", here, f"include {pattern!r}: {d.message}", d.hint, d.code))
                continue
            if sub is None:
                continue
            if not isinstance(sub, dict):
                problems.append(at("error", sub_source.root, "an included file must be a mapping",
                                   f"give it top-level keys among: {', '.join(INCLUDABLE)}", "include"))
                continue
            for key, value in sub.items():
                kpos = sub_source.key((key,))
                if key not in INCLUDABLE:
                    problems.append(at("error", kpos, f"{key!r} cannot be set in an included file",
                                       f"included files may hold only: {', '.join(INCLUDABLE)}", "include"))
                    continue
                if value is None:
                    continue
                if not isinstance(value, list):
                    problems.append(at("error", kpos, f"{key} must be a list", None, "type"))
                    continue
                target = data.setdefault(key, [])
                if target is None:
                    target = data[key] = []
                if not isinstance(target, list):
                    continue  # the main file's own type error is reported by validation
                offset = len(target)
                target.extend(value)
                for table, sub_table in ((source.keys, sub_source.keys), (source.values, sub_source.values)):
                    for p, pos in sub_table.items():
                        if len(p) >= 2 and p[0] == key and isinstance(p[1], int):
                            table[(key, p[1] + offset) + p[2:]] = pos
    return problems


# --------------------------------------------------------------------------- pydantic errors → diagnostics


def _data_path(loc: tuple[Any, ...], data: Any) -> Path:
    """Map a pydantic error location onto the data (dropping union tags that are not keys)."""
    path: list[str | int] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(part)
            node = node[part]
        elif isinstance(node, dict) and isinstance(part, str) and part.startswith("[key]"):
            continue
        else:
            continue
    return tuple(path)


def _allowed_keys(loc: tuple[Any, ...], root: type[BaseModel]) -> list[str]:
    """The keys the model accepts at the mapping that holds the last element of ``loc``."""
    tp: Any = root
    for part in loc[:-1]:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            f = tp.model_fields.get(part) if isinstance(part, str) else None
            if f is None:
                return []
            tp = f.annotation
            continue
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin in (list, tuple) and isinstance(part, int):
            tp = args[0] if args else Any
        elif origin is dict:
            tp = args[1] if len(args) == 2 else Any
        elif origin in (typing.Union, types.UnionType):
            chosen = None
            for arg in args:
                arg = _unwrap(arg)
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    proto = arg.model_fields.get("protocol")
                    if proto is not None and part in typing.get_args(proto.annotation):
                        chosen = arg
            if chosen is None:
                return []
            tp = chosen
        else:
            return []
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [name for name, f in tp.model_fields.items() if not f.exclude]
    return []


def _unwrap(tp: Any) -> Any:
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
            continue
        if origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) == 1:
                tp = args[0]
                continue
        return tp


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    if value is None:
        return "nothing (null)"
    return type(value).__name__


def _pydantic_diagnostic(err: ErrorDetails, data: Any, source: SourceMap, root: type[BaseModel] = Cluster) -> Diagnostic:
    loc = tuple(err["loc"])
    path = _data_path(loc, data)
    kind = err["type"]
    value = err.get("input")
    ctx = err.get("ctx") or {}
    field_name = next((p for p in reversed(path) if isinstance(p, str)), "value")
    shown = repr(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else _describe(value)

    if kind == "extra_forbidden":
        key = loc[-1]
        allowed = _allowed_keys(loc, root)
        close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else (f"allowed keys here: {', '.join(allowed)}" if allowed else None)
        return at("error", source.key(path), f"unknown key {key!r}", hint, "unknown-key")
    if kind == "missing":
        key = loc[-1]
        return at("error", source.key(path), f"missing required key {key!r}", f"add `{key}:` here", "missing")
    if kind == "union_tag_invalid":
        expected = ctx.get("expected_tags", "")
        tags = [t.strip().strip("'") for t in str(expected).split(",")]
        close = difflib.get_close_matches(str(ctx.get("tag")), tags, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else f"use one of: {expected}"
        return at("error", source.value(path + ("protocol",)), f"unknown protocol {ctx.get('tag')!r}", hint, "protocol")
    if kind == "union_tag_not_found":
        return at("error", source.key(path), "inbound has no `protocol`",
                  "add `protocol:` with one of vless-reality, vless-tls, trojan, shadowsocks-2022, hysteria2, tuic", "protocol")
    pos = source.value(path)
    if kind == "literal_error":
        expected = ctx.get("expected", "")
        options = [o.strip().strip("'") for o in str(expected).replace(" or ", ", ").split(",")]
        close = difflib.get_close_matches(str(value), options, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else f"use one of: {expected}"
        if "[key]" in loc:
            return at("error", source.key(path + (value,)) if (path + (value,)) in source.keys else pos,
                      f"{field_name}: {shown} is not a known key here", hint, "value")
        return at("error", pos, f"{field_name}: {shown} is not allowed", hint, "value")
    if kind in ("less_than_equal", "greater_than_equal", "less_than", "greater_than"):
        bound = {"less_than_equal": "at most", "greater_than_equal": "at least",
                 "less_than": "less than", "greater_than": "greater than"}[kind]
        limit = next(iter(ctx.values()), "?")
        hint = "ports are 1 to 65535" if field_name.endswith("port") else None
        return at("error", pos, f"{field_name}: {shown} is out of range (must be {bound} {limit})", hint, "range")
    if kind == "string_pattern_mismatch":
        if field_name in ("name", "id", "route", "pool", "fallback_pool", "pools") or path[-2:-1] == ("pools",):
            return at("error", pos, f"{field_name}: {shown} is not a valid identifier",
                      "use lower-case letters, digits, '.', '_' and '-' (e.g. fra-1)", "pattern")
        return at("error", pos, f"{field_name}: {shown} has the wrong form", f"it must match {ctx.get('pattern')}", "pattern")
    if kind in ("string_type",):
        return at("error", pos, f"{field_name}: expected text, got {_describe(value)}",
                  "put the value in quotes", "type")
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return at("error", pos, f"{field_name}: expected a whole number, got {shown}", None, "type")
    if kind in ("float_type", "float_parsing"):
        return at("error", pos, f"{field_name}: expected a number, got {shown}", None, "type")
    if kind in ("bool_type", "bool_parsing"):
        return at("error", pos, f"{field_name}: expected true or false, got {shown}", None, "type")
    if kind in ("list_type",):
        return at("error", pos, f"{field_name}: expected a list, got {_describe(value)}",
                  "write a list with `- item` lines or [a, b]", "type")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return at("error", pos, f"{field_name}: expected a mapping of keys, got {_describe(value)}", None, "type")
    if kind in ("string_too_short",):
        return at("error", pos, f"{field_name}: must not be empty", None, "value")
    if kind in ("string_too_long",):
        return at("error", pos, f"{field_name}: is too long (at most {ctx.get('max_length')} characters)", None, "value")
    if kind in ("date_from_datetime_parsing", "date_parsing", "datetime_parsing", "date_type", "datetime_type"):
        return at("error", pos, f"{field_name}: {shown} is not a date", "write dates as YYYY-MM-DD", "type")
    if kind == "value_error":
        message = str(err.get("msg", "")).removeprefix("Value error, ")
        return at("error", pos, f"{field_name}: {message}" if field_name != "value" else message, None, "value")
    return at("error", pos, f"{field_name}: {err.get('msg')}", None, kind)


# --------------------------------------------------------------------------- entry points


def load_document(path: str, model: type[BaseModel], display: str | None = None) -> tuple[Any, list[Diagnostic], SourceMap]:
    """Load any YAML document into ``model`` with the same positioned diagnostics as the cluster file.

    Returns (instance or None, diagnostics, source map). Never raises for bad input.
    """
    display = display or path
    try:
        data, source = _read_yaml(path, display)
    except _Problem as p:
        return None, [p.diagnostic], SourceMap()
    if not isinstance(data, dict):
        return None, [at("error", source.root, f"the top level must be a mapping, not {_describe(data)}", None, "type")], source
    try:
        return model.model_validate(data), [], source
    except ValidationError as exc:
        return None, [_pydantic_diagnostic(e, data, source, model) for e in exc.errors()], source


def load_cluster(path: str, display: str | None = None, overrides: dict[str, str] | None = None) -> LoadResult:
    """Load, merge includes, validate the schema and the semantics. Never raises for bad input.

    ``overrides``: absolute path → text to use instead of that file's content.
    """
    display = display or path
    result = LoadResult(path=display, cluster=None)
    _load_into(result, path, display, overrides)
    result.diagnostics.sort(key=lambda d: (d.severity != "error", d.file != display, d.file, d.line, d.col))
    return result


def _load_into(result: LoadResult, path: str, display: str, overrides: dict[str, str] | None) -> None:
    try:
        data, source = _read_yaml(path, display, overrides)
    except _Problem as p:
        result.diagnostics.append(p.diagnostic)
        return
    result.source = source
    if data is None:
        result.diagnostics.append(at("error", source.root, "the file is empty",
                                     "start from `reconciler init` or cluster.example.yaml", "empty"))
        return
    if not isinstance(data, dict):
        result.diagnostics.append(at("error", source.root, f"the top level must be a mapping, not {_describe(data)}",
                                     "the file holds the keys settings, servers, routes and users", "type"))
        return
    for key in [k for k in data if not isinstance(k, str)]:
        result.diagnostics.append(at("error", source.key((key,)), f"key {key!r} must be text", None, "type"))
        return
    result.diagnostics.extend(_merge_includes(data, path, display, source, overrides))
    try:
        cluster = Cluster.model_validate(data)
    except ValidationError as exc:
        result.diagnostics.extend(_pydantic_diagnostic(e, data, source) for e in exc.errors())
        return
    if result.errors:
        return
    result.diagnostics.extend(check(cluster, source))
    if not result.errors:
        result.cluster = cluster
