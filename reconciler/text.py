"""Words for the operator (pure): counts with their nouns in the right number, never "server(s)"."""

from __future__ import annotations


def plural(n: int, one: str, many: str | None = None) -> str:
    """``1 server``, ``2 servers``; ``many`` for irregular nouns (``plural(2, "entry", "entries")``)."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def verb(n: int, one: str, many: str) -> str:
    """The verb that agrees with a count: ``verb(1, "is", "are")``."""
    return one if n == 1 else many
