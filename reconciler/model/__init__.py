"""Typed desired state. Pure: imports nothing else of ours."""

from reconciler.model.cluster import (
    ENGINE_VERSIONS,
    IMPLICIT_ROUTE_ID,
    TRANSPORTS,
    Cluster,
    EngineName,
    EngineSettings,
    Inbound,
    InboundRef,
    Route,
    Server,
    Settings,
    User,
)
from reconciler.model.regions import COUNTRY_REGION, REGIONS, region_of
from reconciler.model.usage import UserUsage

__all__ = [
    "COUNTRY_REGION", "ENGINE_VERSIONS", "IMPLICIT_ROUTE_ID", "REGIONS", "TRANSPORTS", "Cluster", "EngineName",
    "EngineSettings", "Inbound", "InboundRef", "Route", "Server", "Settings", "User", "UserUsage", "region_of",
]
