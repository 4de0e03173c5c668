"""The line a fit prints when it records a failure and goes on (``progress=True``): what
happened and how training continues, from the failure record alone (pure)."""

from __future__ import annotations

from typing import Any


def failure_line(record: Any) -> str | None:
    """The console line of a ``history.info["failures"]`` entry, or None where another
    line says it (a release of lost replicas: ``ReleaseReplicas``'s) or none is due."""
    reason, step = record["reason"], record["commit_step"]
    if "kept_window" in record and not record["kept_window"]:
        return None  # a release begins: the loop's ReleaseReplicas line says so
    if record.get("kept_window"):
        return (
            f"dataflow: the window in flight is kept ({record['retrained_parts']} part(s) "
            f"trained again); going on from step {step} on "
            f"{record.get('replicas_after')} replica(s)"
        )
    if reason == "lost workers":
        return (
            f"dataflow: lost worker(s) {', '.join(record['lost'])}; rolling back to step "
            f"{step} on {record.get('replicas_after')} replica(s)"
        )
    if reason == "out-of-memory":
        return (
            f"dataflow: replica {record['rank']} ran out of device memory with "
            f"micro-batches of {record['micro_batch']} samples; redoing from step "
            f"{step} with micro-batches of at most {record['micro_batch_cap']}"
        )
    if reason == "stalled":
        slow = record.get("slow_replicas")
        return (
            f"dataflow: replica {record['rank']} waited for its peers past "
            "collective_timeout_s while every worker stayed alive (a slow step, not a "
            "lost worker" + (f": replica(s) {slow} still in their step" if slow else "") + "); "
            f"redoing from step {step}"
        )
    if reason == "slow replica dropped":
        return (
            f"dataflow: replica(s) {record.get('slow_replicas')} stalled the phase past "
            f"max_stalls; going on without worker(s) {', '.join(record['lost'])} from "
            f"step {step} on {record.get('replicas_after')} replica(s)"
        )
    if reason == "non-finite":
        return (
            f"dataflow: {record.get('error')}; rolling back to step {step}, "
            f"LR x {record.get('lr_factor')}"
        )
    return None
