"""A user's subscription URLs (pure): the one place that builds ``<base>/sub/<token>[/<format>]``.

``reconciler user url`` prints them under ``settings.outputs.public_url``; the page a browser gets at
``/sub/<token>`` shows them (and their QR codes) under that base, or, when it is not set, under the base
the request itself came to (``request_base``).
"""

from __future__ import annotations

import re

# A Host header as the page may repeat it: a name or address and an optional port, nothing else.
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\])(?::[0-9]{1,5})?$")


def subscription_url(base: str, token: str, fmt: str | None = None) -> str:
    """``base`` + ``/sub/<token>``, + ``/<format>`` when one is pinned (else the app's User-Agent chooses)."""
    return f"{base.rstrip('/')}/sub/{token}" + (f"/{fmt}" if fmt else "")


def request_base(public_url: str | None, scheme: str, host: str | None) -> str | None:
    """The base of the URLs shown to a browser: ``public_url`` when the file sets it, else the request's own
    scheme and Host; None when neither is usable (a missing or malformed Host)."""
    if public_url:
        return public_url.rstrip("/")
    if scheme not in ("http", "https") or not host or not _HOST.match(host):
        return None
    return f"{scheme}://{host}"
