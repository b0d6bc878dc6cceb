"""The fleet core (pure): agent reports parsed at the edge into typed values, folded into the
learned state, and the one snapshot every consumer answers from.

- ``reports``: the agent's request and its report → ``Report``; reports → the health engine's
  ``Observation``; traffic counters → rates across engine restarts;
- ``learned``: ``Learned``, what the controller knows between intervals, and its persisted form;
- ``snapshot``: ``snapshot(cluster, learned, facts, now)``.

No I/O: the loop collects, the state folder persists, the outlets publish.
"""

from reconciler.fleet.learned import Learned
from reconciler.fleet.reports import Report, parse_report
from reconciler.fleet.snapshot import snapshot

__all__ = ["Learned", "Report", "parse_report", "snapshot"]
