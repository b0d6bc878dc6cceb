"""A user as the database holds it, and back (pure: no connection here).

One row per user in ``reconciler_users``; its columns are the YAML ``users:`` keys, flattened: ``reset`` becomes
``reset_period`` and ``reset_day``, ``expires`` a UTC timestamp (a date in the file means the end of that day, as
``User.expires_at`` reads it). A row is hostile input: each one is validated by the same model the file's users are,
and a bad row is left out with one diagnostic naming its key, never the end of the load.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from reconciler.model.cluster import User

#: The columns, in the order every query selects them.
COLUMNS = ("name", "enabled", "region", "expires", "data_limit", "reset_period", "reset_day", "device_limit",
           "on_device_limit", "rotate")
SELECT = f"SELECT {', '.join(COLUMNS)} FROM reconciler_users"


def user_of(row: Sequence[Any]) -> User | str:
    """The user a row holds, or why it holds none (one line, naming nothing but the row's key)."""
    name, enabled, region, expires, data_limit, period, day, device_limit, on_device_limit, rotate = row
    data: dict[str, Any] = {"name": name}
    if enabled is not True:
        data["enabled"] = enabled
    if region is not None:
        data["region"] = region
    if expires is not None:
        data["expires"] = expires
    if data_limit is not None:
        data["data_limit"] = data_limit
    if period not in (None, "never") or day is not None:
        data["reset"] = {"period": period or "never", "day": int(day) if isinstance(day, str) and day.isdigit() else day}
    if device_limit is not None:
        data["device_limit"] = device_limit
    if on_device_limit not in (None, "report"):
        data["on_device_limit"] = on_device_limit
    if rotate:
        data["rotate"] = rotate
    try:
        return User.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "row"
        return f"{where}: {first['msg']}"


def row_of(user: User) -> tuple[Any, ...]:
    """The row ``user`` becomes (``reconciler users import``)."""
    expires = None
    if user.expires_at is not None:
        expires = datetime.fromtimestamp(user.expires_at, UTC)
    day = user.reset.day
    return (user.name, user.enabled, user.region, expires, user.data_limit, user.reset.period,
            None if day is None else str(day), user.device_limit, user.on_device_limit, user.rotate)
