"""Capacity estimates from observed traffic peaks (LB-3). Pure, vectorised, time passed in.

A server's capacity is the highest traffic it has carried, cooling down
exponentially (``capacity_half_life``) while it is not loaded that hard again.
No estimate exists until a real peak was seen (LB-5 then falls back to
round-robin). The estimate never drops below ``FLOOR_MBPS`` once known: an idle
server must stay attractive enough to receive the users that would show its
real capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MIN_PEAK_MBPS = 1.0  # below this, traffic says nothing about the channel
FLOOR_MBPS = 1.0


@dataclass
class CapacityEstimator:
    half_life: float
    peak: np.ndarray = field(default_factory=lambda: np.zeros(0))  # Mbps, NaN = none yet
    peak_time: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @classmethod
    def empty(cls, n: int, half_life: float) -> CapacityEstimator:
        return cls(half_life, np.full(n, np.nan), np.zeros(n))

    def estimate(self, now: float) -> np.ndarray:
        """Current estimates in Mbps (NaN where no real peak was seen yet)."""
        age = np.maximum(0.0, now - self.peak_time)
        estimate: np.ndarray = np.maximum(self.peak * np.exp2(-age / self.half_life), FLOOR_MBPS)
        return estimate

    def observe(self, now: float, traffic_mbps: np.ndarray, valid: np.ndarray) -> None:
        """Fold in one interval's traffic (only where ``valid``: fresh, uncorrupted samples)."""
        current = self.estimate(now)
        real = valid & (traffic_mbps >= MIN_PEAK_MBPS)
        raise_it = real & (np.isnan(current) | (traffic_mbps >= current))
        self.peak = np.where(raise_it, traffic_mbps, self.peak)
        self.peak_time = np.where(raise_it, now, self.peak_time)
