"""Load ``cluster.yaml`` (and its includes) into a ``Cluster`` with positioned diagnostics.

``load_cluster(path)`` never raises for bad input: every problem — unreadable
file, YAML syntax, tabs, duplicate keys, tags, wrong types, unknown keys, broken
references — comes back as a ``Diagnostic`` with ``file:line:col`` and a hint.
The cluster is returned only when there are no errors, so nothing downstream
ever sees a half-valid file.

Reading and parsing one file, bounded, is ``config.yamlread``; includes (confined
to the cluster's folder) are ``config.includes``; this module maps pydantic's
errors onto positions and runs the semantic checks.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ValidationError

from reconciler import gcpause
from reconciler.config import includes, yamlread
from reconciler.config.diagnostics import Diagnostic, Path, Pos, SourceMap, at, shown, unknown_key, wrong_kind
from reconciler.config.semantic import check
from reconciler.config.yamlread import Budget, TopLevel, read_yaml
from reconciler.errors import DatabaseError, Problem, SchemaTooNew, SecretError
from reconciler.model import Cluster
from reconciler.model.cluster import UserSettings
from reconciler.userdb import UserDatabase, dsn_of

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails  # pydantic's own dependency: the type of ValidationError.errors()

INCLUDABLE = includes.INCLUDABLE
MAX_NODES = yamlread.MAX_NODES
MAX_FILE_BYTES = yamlread.MAX_FILE_BYTES


@dataclass
class LoadResult:
    """What loading produced: the cluster (only when valid) and every diagnostic."""

    path: str
    cluster: Cluster | None
    diagnostics: list[Diagnostic] = field(default_factory=list)
    source: SourceMap = field(default_factory=SourceMap)
    bad_users: list[str] = field(default_factory=list)  # the keys of the database's rows left out (users.source)

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "warning"]

    @property
    def ok(self) -> bool:
        return self.cluster is not None and not self.errors


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
    ctx = err.get("ctx") or {}
    found = _key_diagnostic(err["type"], loc, path, ctx, source, root)
    return found if found is not None else _value_diagnostic(err, loc, path, ctx, source)


def _key_diagnostic(kind: str, loc: tuple[Any, ...], path: Path, ctx: dict[str, Any], source: SourceMap,
                    root: type[BaseModel]) -> Diagnostic | None:
    """An error of the mapping's keys (unknown, missing, an inbound's protocol), at the key; None for an error of a value."""
    if kind == "extra_forbidden":
        return unknown_key(source.key(path), loc[-1], _allowed_keys(loc, root))
    if kind == "missing":
        key = loc[-1]
        return at("error", source.key(path), f"missing required key {shown(key)}", f"add `{key}:` here", "missing")
    if kind == "union_tag_invalid":
        expected = ctx.get("expected_tags", "")
        tags = [t.strip().strip("'") for t in str(expected).split(",")]
        close = difflib.get_close_matches(str(ctx.get("tag")), tags, n=1, cutoff=0.5)
        hint: str | None = f"did you mean {close[0]!r}?" if close else f"use one of: {expected}"
        return at("error", source.value(path + ("protocol",)), f"unknown protocol {shown(ctx.get('tag'))}", hint, "protocol")
    if kind == "union_tag_not_found":
        return at("error", source.key(path), "inbound has no `protocol`",
                  "add `protocol:` with one of vless-reality, vless-tls, trojan, shadowsocks-2022, hysteria2, tuic", "protocol")
    return None


def _value_diagnostic(err: ErrorDetails, loc: tuple[Any, ...], path: Path, ctx: dict[str, Any], source: SourceMap) -> Diagnostic:
    """An error of a value the type allows but the field does not (a choice, a bound, a form, a length, a validator's
    verdict), at the value; a value of the wrong type is ``_type_diagnostic``'s."""
    kind = err["type"]
    value = err.get("input")
    field_name = next((p for p in reversed(path) if isinstance(p, str)), "value")
    value_text = shown(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else _describe(value)
    pos = source.value(path)
    if kind == "literal_error":
        expected = ctx.get("expected", "")
        options = [o.strip().strip("'") for o in str(expected).replace(" or ", ", ").split(",")]
        close = difflib.get_close_matches(str(value), options, n=1, cutoff=0.5)
        hint: str | None = f"did you mean {close[0]!r}?" if close else f"use one of: {expected}"
        if "[key]" in loc:
            return at("error", source.key(path + (value,)) if (path + (value,)) in source.keys else pos,
                      f"{field_name}: {value_text} is not a known key here", hint, "value")
        return at("error", pos, f"{field_name}: {value_text} is not allowed", hint, "value")
    if kind in ("less_than_equal", "greater_than_equal", "less_than", "greater_than"):
        bound = {"less_than_equal": "at most", "greater_than_equal": "at least",
                 "less_than": "less than", "greater_than": "greater than"}[kind]
        limit = next(iter(ctx.values()), "?")
        hint = "ports are 1 to 65535" if field_name.endswith("port") else None
        return at("error", pos, f"{field_name}: {value_text} is out of range (must be {bound} {limit})", hint, "range")
    if kind == "string_pattern_mismatch":
        if field_name in ("name", "id", "route", "pool", "fallback_pool", "pools") or path[-2:-1] == ("pools",):
            return at("error", pos, f"{field_name}: {value_text} is not a valid identifier",
                      "use lower-case letters, digits, '.', '_' and '-' (e.g. fra-1)", "pattern")
        return at("error", pos, f"{field_name}: {value_text} has the wrong form", f"it must match {ctx.get('pattern')}", "pattern")
    if kind == "finite_number":
        return at("error", pos, f"{field_name}: {value_text} is not a finite number", "write a number such as 1.5", "range")
    if kind in ("string_too_short",):
        return at("error", pos, f"{field_name}: must not be empty", None, "value")
    if kind in ("string_too_long",):
        return at("error", pos, f"{field_name}: is too long (at most {ctx.get('max_length')} characters)", None, "value")
    if kind == "value_error":
        message = str(err.get("msg", "")).removeprefix("Value error, ")
        return at("error", pos, f"{field_name}: {message}" if field_name != "value" else message, None, "value")
    return _type_diagnostic(err, pos, field_name, value_text)


def _type_diagnostic(err: ErrorDetails, pos: Pos | None, field_name: str, value_text: str) -> Diagnostic:
    """An error of a value of the wrong type (text, number, true/false, list, mapping, date) at ``pos``, or any other
    error pydantic reports there, in its own words."""
    kind = err["type"]
    value = err.get("input")
    if kind in ("string_type",):
        return at("error", pos, f"{field_name}: expected text, got {_describe(value)}",
                  "put the value in quotes", "type")
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return at("error", pos, f"{field_name}: expected a whole number, got {value_text}", None, "type")
    if kind in ("float_type", "float_parsing"):
        return at("error", pos, f"{field_name}: expected a number, got {value_text}", None, "type")
    if kind in ("bool_type", "bool_parsing"):
        return at("error", pos, f"{field_name}: expected true or false, got {value_text}", None, "type")
    if kind in ("list_type",):
        return wrong_kind(pos, field_name, "list", _describe(value))
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return wrong_kind(pos, field_name, "mapping", _describe(value))
    if kind in ("date_from_datetime_parsing", "date_parsing", "datetime_parsing", "date_type", "datetime_type"):
        return at("error", pos, f"{field_name}: {value_text} is not a date", "write dates as YYYY-MM-DD", "type")
    return at("error", pos, f"{field_name}: {err.get('msg')}", None, kind)


def top_level(model: type[BaseModel]) -> TopLevel | None:
    """What ``model`` lets a file's top level hold, for the composer to stop the file at the first key or kind there
    the model cannot hold (``yamlread.TopLevel``), before it composes that key's value; None when a validator of the
    model may reshape its input before the fields see it."""
    decorators = model.__pydantic_decorators__
    if any(d.info.mode in ("before", "wrap", "plain") for d in decorators.model_validators.values()):
        return None
    reshaped = {name for d in decorators.field_validators.values() if d.info.mode != "after" for name in d.info.fields}
    keys: dict[str, Literal["list", "mapping"] | None] = {}
    records = set()
    for name, f in model.model_fields.items():
        tp = _unwrap(f.annotation)
        kind: Literal["list", "mapping"] | None = None
        if name in reshaped:
            kind = None
        elif typing.get_origin(tp) in (list, tuple, set, frozenset):
            kind = "list"
            if _is_model(typing.get_args(tp)[0] if typing.get_args(tp) else None):
                records.update({name, f.alias or name})
        elif typing.get_origin(tp) is dict or _is_model(tp):
            kind = "mapping"
        keys[name] = kind
        if f.alias:
            keys[f.alias] = kind
    return TopLevel(keys, closed=model.model_config.get("extra") == "forbid", records=frozenset(records))


def _is_model(tp: Any) -> bool:
    """Whether ``tp`` is a model, or a union of models (``Inbound``): a mapping in YAML."""
    tp = _unwrap(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return all(_is_model(arg) for arg in typing.get_args(tp))
    return isinstance(tp, type) and issubclass(tp, BaseModel)


# --------------------------------------------------------------------------- entry points


def load_document(path: str, model: type[BaseModel], display: str | None = None) -> tuple[Any, list[Diagnostic], SourceMap]:
    """Load any YAML document into ``model`` with the same positioned diagnostics as the cluster file.

    Returns (instance or None, diagnostics, source map). Never raises for bad input.
    """
    display = display or path
    try:
        data, source = read_yaml(path, display, top=top_level(model))
    except Problem as p:
        return None, [p.diagnostic], SourceMap()
    if not isinstance(data, dict):
        return None, [at("error", source.root, f"the top level must be a mapping, not {_describe(data)}", None, "type")], source
    try:
        return model.model_validate(data), [], source
    except ValidationError as exc:
        return None, [_pydantic_diagnostic(e, data, source, model) for e in exc.errors()], source


def load_cluster(path: str, display: str | None = None, overrides: dict[str, str] | None = None,
                 migrate_users: bool = False) -> LoadResult:
    """Load, merge includes, validate the schema and the semantics. Never raises for bad input.

    ``overrides``: absolute path → text to use instead of that file's content. ``migrate_users``: a users' database
    with an older schema is migrated first (a start does; the commands that only read refuse it instead).
    """
    display = display or path
    result = LoadResult(path=display, cluster=None)
    _load_into(result, path, display, overrides, migrate_users)
    result.diagnostics.sort(key=lambda d: (d.severity != "error", d.file != display, d.file, d.line, d.col))
    return result


MAX_ERRORS = 200  # diagnostics kept from one validation: a flood of bad records is told, never hoarded
#: The cluster file's top level, as ``Cluster`` holds it: the composer stops the file at an unknown key there, or a
#: list where a mapping belongs (or the other way round), before it composes what that key holds.
CLUSTER_TOP = top_level(Cluster)


def _not_records(result: LoadResult, data: dict[str, Any], source: SourceMap) -> bool:
    """A list of servers or users whose items are not mappings, by the thousand: told (the first few) before the
    model would build an error for each of millions."""
    for key in ("servers", "users"):
        items = data.get(key)
        if not isinstance(items, list) or len(items) <= MAX_ERRORS:
            continue
        bad = [i for i, item in enumerate(items) if not isinstance(item, dict)]
        if len(bad) > MAX_ERRORS:
            result.diagnostics.extend(at("error", source.value((key, i)), f"{key}[{i}] must be a mapping, not "
                                         f"{_describe(items[i])}", None, "type") for i in bad[:MAX_ERRORS])
            result.diagnostics.append(at("error", source.key((key,)), f"… and {len(bad) - MAX_ERRORS} more {key} that "
                                         "are not mappings", f"each of {key} is a mapping, e.g. `- name: alice`", "many"))
            return True
    return False


def _database_users(result: LoadResult, data: dict[str, Any], source: SourceMap, migrate: bool) -> bool:
    """With ``settings.users.source: postgres`` the users are the database's rows: read them into ``data`` (a bad row
    left out with a warning naming its key). False, with the error said, when they cannot be read; True otherwise."""
    settings = data.get("settings")
    raw = settings.get("users") if isinstance(settings, dict) else None
    if not isinstance(raw, dict) or raw.get("source") != "postgres":
        return True
    try:
        chosen = UserSettings.model_validate(raw)
    except ValidationError:
        return True  # the model's own diagnostics say what is wrong with these settings
    where = source.value(("settings", "users", "source"))
    if data.get("users"):
        result.diagnostics.append(at("error", source.key(("users",)), "the file lists users, but settings.users.source "
                                     "is postgres: the users are the database's rows",
                                     "move them with `reconciler users import`, then delete the list", "users-source"))
        return False
    try:
        db = UserDatabase(dsn_of(chosen))
        if migrate:
            db.migrate()
        loaded = db.load()
    except (DatabaseError, SchemaTooNew, SecretError) as exc:
        result.diagnostics.append(at("error", where, str(exc), "the users cannot be known without it; nothing was "
                                     "changed", "database"))
        return False
    for key, why in loaded.bad[:MAX_ERRORS]:
        result.diagnostics.append(at("warning", where, f"the database's user {key!r} is left out: {why}",
                                     "fix that row; every other user is served", "bad-row"))
    if len(loaded.bad) > MAX_ERRORS:
        result.diagnostics.append(at("warning", where, f"… and {len(loaded.bad) - MAX_ERRORS} more bad rows", None,
                                     "bad-row"))
    result.bad_users = [key for key, _ in loaded.bad]
    data["users"] = loaded.users
    return True


def _load_into(result: LoadResult, path: str, display: str, overrides: dict[str, str] | None, migrate_users: bool) -> None:
    budget = Budget()  # shared by the main file and its includes
    try:
        data, source = read_yaml(path, display, overrides, budget, top=CLUSTER_TOP)
    except Problem as p:
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
        result.diagnostics.append(at("error", source.key((key,)), f"key {shown(key)} must be text", None, "type"))
        return
    result.diagnostics.extend(includes.merge_includes(data, path, display, source, overrides, budget))
    if _not_records(result, data, source) or not _database_users(result, data, source, migrate_users):
        return
    try:
        with gcpause.paused():  # millions of users: the collector would walk them again and again
            cluster = Cluster.model_validate(data)
    except ValidationError as exc:
        count = exc.error_count()
        result.diagnostics.extend(_pydantic_diagnostic(e, data, source) for e in exc.errors()[:MAX_ERRORS])
        if count > MAX_ERRORS:
            result.diagnostics.append(at("error", source.root, f"… and {count - MAX_ERRORS} more errors",
                                         f"fix the first {MAX_ERRORS} and validate again", "many"))
        return
    if result.errors:
        return
    result.diagnostics.extend(check(cluster, source, path))
    if not result.errors:
        result.cluster = cluster
