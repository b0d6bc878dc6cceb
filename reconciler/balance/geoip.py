"""The region of a live request's client address (STEER-4), from an operator-supplied MaxMind-format database.

Reads GeoLite2/GeoIP2-Country or -City databases (any MMDB with ``country.iso_code``,
or ``registered_country.iso_code``) through ``maxminddb``. Nothing is downloaded:
the operator names the file in ``settings.steering.geoip_database``. An address
the database does not know, or a missing database, gives ``None`` — the caller
then uses the user record's region, else failover order.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import maxminddb

from reconciler.model.regions import COUNTRY_REGION


class GeoIP:
    def __init__(self, path: str):
        self.reader = maxminddb.open_database(path)

    def country(self, address: str) -> str | None:
        try:
            ipaddress.ip_address(address)
            record = self.reader.get(address)
        except (ValueError, TypeError):
            return None
        if not isinstance(record, dict):
            return None
        for key in ("country", "registered_country"):
            entry = record.get(key)
            code = entry.get("iso_code") if isinstance(entry, dict) else None
            if isinstance(code, str) and code.upper() in COUNTRY_REGION:
                return code.upper()
        return None

    def region(self, address: str) -> str | None:
        code = self.country(address)
        return COUNTRY_REGION.get(code) if code else None

    def close(self) -> None:
        self.reader.close()


@lru_cache(maxsize=4)
def open_geoip(path: str) -> GeoIP:
    """One reader per database file for the process (memory-mapped, shared by all requests)."""
    return GeoIP(path)


def database_path(base_dir: str | Path, setting: str) -> Path:
    """Where ``settings.steering.geoip_database`` points: ``~`` expanded, relative to the cluster file's folder."""
    return Path(base_dir) / os.path.expanduser(setting)


def region_lookup(base_dir: str | Path, setting: str | None, warn: Callable[[str], None]) -> Callable[[str], str | None] | None:
    """The region of an address per the database ``setting`` names; None without one, or (``warn`` told why) when
    it cannot be read: live requests then use the users' regions. The one place the loop and its workers open it."""
    if not setting:
        return None
    try:
        return open_geoip(str(database_path(base_dir, setting))).region
    except (OSError, ValueError) as exc:
        warn(f"cannot read the GeoIP database {setting}: {exc}; live requests use the users' regions")
        return None
