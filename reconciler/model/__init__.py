"""Typed desired state. Pure: imports nothing else of ours."""

from reconciler.model.cluster import (
    IMPLICIT_ROUTE_ID,
    TRANSPORTS,
    Cluster,
    Inbound,
    InboundRef,
    Route,
    Server,
    Settings,
    User,
)
from reconciler.model.regions import COUNTRY_REGION, REGIONS, region_of

__all__ = [
    "COUNTRY_REGION", "IMPLICIT_ROUTE_ID", "REGIONS", "TRANSPORTS", "Cluster", "Inbound", "InboundRef",
    "Route", "Server", "Settings", "User", "region_of",
]
