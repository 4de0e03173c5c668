"""The line a fit prints when it records a failure and goes on (``progress=True``): what
happened and how training continues, from the failure record alone; and the message of
the ``WorkerLostError`` that stops it when it cannot go on (pure)."""

from __future__ import annotations

from typing import Any

from dataflow.planning.layout import fewer_workers_hint


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


def lost_workers_message(
    c: Any,
    *,
    min_workers: int,
    config: Any,
    saved_path: Any = None,
    newest: Any = None,
    folder: Any = None,
) -> str:
    """What a ``cmd.Fail`` about lost workers says: who was lost, why the fit cannot go
    on, and where its work is kept (``saved_path``: a checkpoint of the commit written
    now; else ``newest`` in the checkpoint ``folder``; no ``folder``: none was given);
    ``config``: the machine's (``spatial``, ``max_restarts``)."""
    spatial = config.spatial
    remain = f"{c.remain} remain but min_workers={min_workers}"
    if spatial > 1 and c.workers_left is not None:  # name the layout they could run
        hint = fewer_workers_hint(spatial, c.workers_left, min_workers)
        remain = f"{c.remain} sample group(s) remain: {hint}"
    elif c.starting:
        remain = f"{c.remain} remain (min_workers={min_workers})"
    if c.not_recovering:
        remain = "recover_lost_workers=False: a lost worker stops the fit"
    if c.waited_s is not None:  # every replica lost, and none came back in time
        remain = (
            f"every replica was lost and fewer than min_workers={min_workers} came back in "
            f"restart_wait_s={c.waited_s:g} s (a batch system slower to start workers "
            "again: raise it)"
        )
    if c.starting:
        return f"lost worker(s) {', '.join(c.lost)} while starting the fit; {remain}"
    if saved_path is not None:
        where = (
            f"A checkpoint of step {c.commit_step} (the last window every replica "
            f"finished) was written to {saved_path}; "
        )
    elif folder is None:
        where = "No checkpoint_dir was given, so the work done is lost; "
    elif newest is not None:
        where = f"The newest checkpoint is {newest}; "
    else:
        where = f"No checkpoint was written yet in {folder}; "
    message = (
        f"lost worker(s) {', '.join(c.lost)} in phase {c.phase}; {remain}. {where}fit(..., "
        "checkpoint_dir=..., resume=True) continues from the newest checkpoint once "
        "workers are back"
    )
    if c.restarts_from is not None:
        n = config.max_restarts
        message += (
            f" (the fit started again from step {c.restarts_from} "
            f"{'once' if n == 1 else f'{n} times'} and lost every replica each time before "
            f"the next checkpoint: max_restarts={n} allows no more)"
        )
    return message
