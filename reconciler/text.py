"""Words for the operator (pure): counts with their nouns in the right number, never "server(s)"; what others sent
made safe to print (``printable``); URLs without the parts that carry tokens (``url_for_log``)."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit


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


# C0 controls but line feed and tab, DEL and C1 controls: what a terminal or a CI log's viewer acts on (ESC starts
# CSI and OSC sequences that clear the screen, retitle the window or write to the clipboard; C1 0x9b is CSI alone).
# Then the characters that move or reorder what is shown: U+2028/2029 (line and paragraph separators) and the bidi
# embeddings, overrides and isolates (U+202A–202E, U+2066–2069) that make a line read other than it is.
_CONTROLS = [c for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if chr(c) not in "\n\t"]
_INVISIBLE = [0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_SHOWN = {c: f"\\x{c:02x}" for c in _CONTROLS} | {c: f"\\u{c:04x}" for c in _INVISIBLE}
_JSON = {c: f"\\u{c:04x}" for c in (*range(0x7F, 0xA0), *_INVISIBLE)}


def printable(text: str) -> str:
    """``text`` as it may reach a terminal or a log: every control character but ``\\n`` and ``\\t``, and the
    separators and bidi controls, written as a visible escape (``\\x1b``, ``\\u202e``). The one place that makes
    what a server, a client or a file sent safe to print; what we print ourselves (colours) is added after."""
    return text.translate(_SHOWN)


def printable_json(document: str) -> str:
    """A JSON text with DEL, the C1 controls, the separators and the bidi controls written as ``\\uXXXX``
    (``json.dumps(..., ensure_ascii=False)`` escapes C0 only): the same data, safe to print."""
    return document.translate(_JSON)


def url_for_log(url: str) -> str:
    """A URL as a log line may show it: ``https://host:port/…``. The user information, path, query and fragment are
    left out, whole: webhook and API URLs carry their tokens there."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
    except ValueError:
        return "(a URL that cannot be parsed)"
    host = f"[{host}]" if ":" in host else host
    rest = "/…" if parts.path.strip("/") or parts.query or parts.fragment else ""
    return f"{parts.scheme}://{host}{f':{port}' if port is not None else ''}{rest}"


def without_url_secrets(text: str, url: str) -> str:
    """``text`` (an error's message) with ``url`` written as ``url_for_log`` writes it and every part of it that
    may be secret — user information, path, query, fragment, of four characters or more — cut out wherever it
    appears on its own."""
    text = text.replace(url, url_for_log(url))
    try:
        parts = urlsplit(url)
        secrets = [parts.username, parts.password, parts.path, parts.query, parts.fragment]
    except ValueError:
        return text
    for secret in sorted({s for s in secrets if s and len(s.strip("/")) >= 4}, key=len, reverse=True):  # shorter: no secret
        text = text.replace(secret, "…")
    return text


class PrintableFormatter(logging.Formatter):
    """Log lines carry what servers, clients and the CA sent (errors, verdict reasons): each is made printable
    (``printable``) so no escape sequence reaches the journal's or a CI log's viewer, and a line break in a message
    is shown as ``\\n``, so no text from a server forges a log line of its own (a traceback keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # logging's name
        return super().formatMessage(record).replace("\r", "\\r").replace("\n", "\\n")

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def iso_time(t: float) -> str:
    """A moment as JSON and YAML give it: ISO 8601 in UTC to the second (``2027-06-30T23:59:59Z``)."""
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def lasted_text(seconds: float) -> str:
    """How long something lasted, as people read it: ``45s``, ``12m``, ``3h 05m``, ``2d 04h``."""
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"
