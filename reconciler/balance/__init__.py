"""Balancing and steering (LB-1..9, STEER-1..5): pure decisions over an immutable snapshot."""

from reconciler.balance.capacity import CapacityEstimator
from reconciler.balance.decide import Entry, decide, rebalance
from reconciler.balance.snapshot import RTTProfile, ServerLoad, Snapshot

__all__ = ["CapacityEstimator", "Entry", "RTTProfile", "ServerLoad", "Snapshot", "decide", "rebalance"]
