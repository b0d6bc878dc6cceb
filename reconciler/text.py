"""Words for the operator (pure): counts with their nouns in the right number, never "server(s)"."""

from __future__ import annotations


def plural(n: int, one: str, many: str | None = None) -> str:
    """``1 server``, ``2 servers``; ``many`` for irregular nouns (``plural(2, "entry", "entries")``)."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def verb(n: int, one: str, many: str) -> str:
    """The verb that agrees with a count: ``verb(1, "is", "are")``."""
    return one if n == 1 else many


def size_text(n: int) -> str:
    """Bytes as people read them: 1.5 GB (decimal units, like the file's `data_limit`)."""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"
