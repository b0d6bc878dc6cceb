"""Health verdicts (HEALTH-1..13): a pure engine, time passed in. See ``engine`` for the rules."""

from reconciler.health.engine import HealthEngine, HealthState, Observation
from reconciler.health.probing import ProbePlan, probe_plan
from reconciler.health.topology import Topology
from reconciler.health.verdicts import STATUS_NAMES, InboundVerdict, Mark, ServerVerdict, Verdicts

__all__ = ["STATUS_NAMES", "HealthEngine", "HealthState", "InboundVerdict", "Mark", "Observation", "ProbePlan",
           "ServerVerdict", "Topology", "Verdicts", "probe_plan"]
