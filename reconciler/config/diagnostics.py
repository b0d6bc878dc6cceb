"""Diagnostics: an error or warning at a place in a file, with a hint.

Every problem the loader or the semantic checks find becomes a ``Diagnostic``;
nothing raises past ``load_cluster``. Positions are 1-based like editors show.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Pos:
    file: str
    line: int  # 1-based
    col: int  # 1-based

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Diagnostic:
    severity: Literal["error", "warning"]
    message: str
    hint: str | None = None
    file: str = ""
    line: int = 0
    col: int = 0
    code: str = ""

    def render(self) -> str:
        where = f"{self.file}:{self.line}:{self.col}: " if self.line else (f"{self.file}: " if self.file else "")
        text = f"{where}{self.severity}: {self.message}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text

    def as_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class SourceMap:
    """Where each part of the loaded data came from: data path → key and value positions."""

    keys: dict[Path, Pos] = field(default_factory=dict)
    values: dict[Path, Pos] = field(default_factory=dict)
    root: Pos | None = None

    def key(self, path: Path) -> Pos | None:
        """Position of the key (or sequence item) at ``path``, else of its nearest ancestor."""
        return self._nearest(self.keys, path)

    def value(self, path: Path) -> Pos | None:
        """Position of the value at ``path``, else of its nearest ancestor."""
        return self._nearest(self.values, path) or self._nearest(self.keys, path)

    def _nearest(self, table: dict[Path, Pos], path: Path) -> Pos | None:
        for n in range(len(path), 0, -1):
            pos = table.get(path[:n])
            if pos is not None:
                return pos
        return self.root


#: A message names values, and a value may be a megabyte long: messages are cut to this.
MAX_MESSAGE = 1000


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` for a message, cut short: a hostile value is never echoed whole."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def at(severity: Literal["error", "warning"], pos: Pos | None, message: str, hint: str | None = None, code: str = "") -> Diagnostic:
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 1] + "…"
    if pos is None:
        return Diagnostic(severity, message, hint, code=code)
    return Diagnostic(severity, message, hint, pos.file, pos.line, pos.col, code)


def unknown_key(pos: Pos | None, key: object, allowed: Sequence[str]) -> Diagnostic:
    """A key the schema does not hold, with the nearest allowed one (or all of them) as the hint: the one wording,
    whether the composer stops a file at its top level or the schema finds it deeper."""
    close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else (f"allowed keys here: {', '.join(allowed)}" if allowed else None)
    return at("error", pos, f"unknown key {shown(key)}", hint, "unknown-key")


def wrong_kind(pos: Pos | None, field_name: str, expected: Literal["list", "mapping"], got: str) -> Diagnostic:
    """A list where the schema holds a mapping, or the other way round (``got``: "a list", "text", …)."""
    if expected == "list":
        return at("error", pos, f"{field_name}: expected a list, got {got}", "write a list with `- item` lines or [a, b]", "type")
    return at("error", pos, f"{field_name}: expected a mapping of keys, got {got}", None, "type")
