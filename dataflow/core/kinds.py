"""What a stage's time counts as: the one classification of stages.

The runtime's throttle (a simulated slow node slows only compute) and the report's
time split both ask a stage for its ``kind`` instead of matching class names.
"""

from __future__ import annotations

__all__ = ["ALLREDUCE", "COMPUTE", "EVALUATE", "KINDS", "LOAD", "TIME_TERMS", "WAITING"]

COMPUTE = "compute"  # this replica's own work: transforms, forward, backward, update
LOAD = "load"  # waiting on data: the prefetched batch was not ready
ALLREDUCE = "allreduce"  # waiting on peers: the part of the allreduce not hidden by backward
EVALUATE = "evaluate"  # held-out evaluation, not training
KINDS = (COMPUTE, LOAD, ALLREDUCE, EVALUATE)

#: Kinds whose time is waiting on data or on peers, not this replica's compute.
WAITING = frozenset({LOAD, ALLREDUCE})

#: The report's term for each kind's time.
TIME_TERMS = {
    COMPUTE: "compute",
    LOAD: "data wait",
    ALLREDUCE: "exposed allreduce",
    EVALUATE: "evaluation",
}
