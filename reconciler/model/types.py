"""Small value types shared by the models: durations, byte sizes, names.

Operators write ``60s``, ``10m``, ``24h`` and ``100GB``; the models hold plain
seconds and bytes so the pure cores never parse text.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, PlainSerializer, WithJsonSchema

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?i?B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}


def parse_duration(value: Any) -> float:
    """``90``, ``"90s"``, ``"1.5m"``, ``"24h"``, ``"7d"``, ``"250ms"`` → seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 60s, 5m or 24h")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    else:
        raise ValueError(f"{value!r} is not a duration; write it like 60s, 5m, 24h or 7d")
    if seconds <= 0:
        raise ValueError("a duration must be greater than zero")
    return seconds


def parse_size(value: Any) -> int:
    """``1000000``, ``"100GB"``, ``"1.5TiB"`` → bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 100GB")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        unit = (m.group(2) or "B").lower()
        size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ValueError(f"{value!r} is not a size; write it like 500MB, 100GB or 1TiB")
    if size <= 0:
        raise ValueError("a size must be greater than zero")
    return size


def format_duration(seconds: float) -> str:
    for unit, factor in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= factor and seconds % factor == 0:
            return f"{int(seconds // factor)}{unit}"
    return f"{seconds:g}s"


Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*(ms|s|m|h|d)?\s*$"},
                {"type": "number", "exclusiveMinimum": 0},
            ],
            "description": "A duration: seconds, or a number with ms, s, m, h or d.",
        }
    ),
]

ByteSize = Annotated[
    int,
    BeforeValidator(parse_size),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*([KMGTPkmgtp]?i?[Bb])?\s*$"},
                {"type": "integer", "exclusiveMinimum": 0},
            ],
            "description": "A size in bytes, or a number with B, KB, MB, GB, TB (or KiB, MiB, GiB, TiB).",
        }
    ),
]

# Names end up in SSH logs, metric labels, file names and URLs: keep them tame.
Name = Annotated[
    str,
    Field(
        pattern=r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$",
        description="Lower-case letters, digits, '.', '_' and '-'; starts and ends with a letter or digit.",
    ),
]
