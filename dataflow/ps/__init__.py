"""The parameter store behind ``dataflow.sync.Async``: the bounded-staleness gate (pure),
the shards that hold the weights and optimizer on workers, and the replicas' client."""

from dataflow.ps.gate import StalenessError, StalenessGate
from dataflow.ps.shard_layout import shard_ranges

__all__ = ["StalenessError", "StalenessGate", "shard_ranges"]
