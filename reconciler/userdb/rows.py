"""A user as the database holds it, and back (pure: no connection here).

One row per user in ``reconciler_users``; its columns are the YAML ``users:`` keys, flattened: ``reset`` becomes
``reset_period`` and ``reset_day``, ``expires`` a UTC timestamp (a date in the file means the end of that day, as
``User.expires_at`` reads it). A row is hostile input: each one is validated by the same model the file's users are,
and a bad row is left out with one diagnostic naming its key, never the end of the load.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import TypeAdapter, ValidationError

from reconciler.model.cluster import User

#: The columns, in the order every query selects them.
COLUMNS = ("name", "enabled", "region", "expires", "data_limit", "reset_period", "reset_day", "device_limit",
           "on_device_limit", "rotate")
SELECT = f"SELECT {', '.join(COLUMNS)} FROM reconciler_users"


USERS = TypeAdapter(list[User])


def users_of(rows: Sequence[Sequence[Any]]) -> tuple[list[User], list[tuple[str, str]]]:
    """The users ``rows`` hold, and (key, why) for each that holds none. Validated as one batch (a quarter faster
    than one at a time at a million rows); a batch with a bad row is done again row by row, to name each."""
    data = [_fields(row) for row in rows]
    try:
        return USERS.validate_python(data), []
    except ValidationError:
        users: list[User] = []
        bad: list[tuple[str, str]] = []
        for row in rows:
            got = user_of(row)
            if isinstance(got, str):
                bad.append((str(row[0])[:80], got))
            else:
                users.append(got)
        return users, bad


def user_of(row: Sequence[Any]) -> User | str:
    """The user a row holds, or why it holds none (one line, naming nothing but the row's key)."""
    try:
        return User.model_validate(_fields(row))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "row"
        return f"{where}: {first['msg']}"


def _fields(row: Sequence[Any]) -> dict[str, Any]:
    """A row as the file would give the user: only the keys that differ from the defaults (the shared ``fields_set``
    of a million users is then one of a few objects)."""
    name, enabled, region, expires, data_limit, period, day, device_limit, on_device_limit, rotate = row
    data: dict[str, Any] = {"name": name}
    if enabled is not True:
        data["enabled"] = enabled
    if region is not None:
        data["region"] = sys.intern(region)  # one string per region, not per user (50 MB at a million)
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
    return data


def row_of(user: User) -> tuple[Any, ...]:
    """The row ``user`` becomes (``reconciler users import``)."""
    expires = None
    if user.expires_at is not None:
        expires = datetime.fromtimestamp(user.expires_at, UTC)
    day = user.reset.day
    return (user.name, user.enabled, user.region, expires, user.data_limit, user.reset.period,
            None if day is None else str(day), user.device_limit, user.on_device_limit, user.rotate)
