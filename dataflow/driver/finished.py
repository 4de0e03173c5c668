"""``fit(resume=True)`` when the newest checkpoint is the end of the very fit asked for.

A batch job that is requeued after its fit finished (preempted while it evaluated or
saved, or requeued by a loop that cannot tell) runs the same command again. Training
on is wrong and failing breaks the job script: the fit's result is in its last
checkpoint already (the weights, the whole history, the sample ledger; the kept best
weights in ``best.pt``), so it is returned as it was, without starting a cluster.
"""

from __future__ import annotations

from typing import Any

from dataflow.checkpoint import ledger_from_state, phase_from_dict
from dataflow.driver.best_weights import BestWeights
from dataflow.driver.fit import averaged_model, best_model
from dataflow.history.result import FitResult, History
from dataflow.runtime.window_parts import optimizer_factory
from dataflow.stages.averaging import averaged_state_dict
from dataflow.stages.forward import build_model
from dataflow.stages.update import build_optimizer


def is_finished(checkpoint: Any, epochs: int, planner: Any = None) -> bool:
    """Whether ``checkpoint`` ends the fit of ``epochs`` asked for: it is at that epoch
    (with a schedule that counts progress, ``planner.counts_progress``: at a phase
    boundary where the schedule has no phase left), or an ``on_epoch`` callback stopped
    that same fit there (``StopTraining``; the checkpoint written at the stop). A fit
    asked for another number of epochs trains on from a stop, as ``fit(more,
    resume=True)`` does."""
    if planner is not None and planner.counts_progress:
        previous = phase_from_dict(checkpoint.schedule_state.get("previous"))
        at_boundary = checkpoint.in_phase is None and previous is not None
        if at_boundary and planner.next_phase(checkpoint.epoch, epochs, previous) is None:
            return True
    elif checkpoint.epoch == epochs:
        return True
    info = checkpoint.history.get("info") or {}
    stop = info.get("stopped_early")
    return (
        stop is not None
        and info.get("epochs") == epochs
        and checkpoint.in_phase is None
        and checkpoint.epoch == stop["after_epoch"] + 1
    )


def finished_result(trainer: Any, checkpoint: Any, store: Any, keep_best: Any = None) -> FitResult:
    """The result of the fit ``checkpoint`` ended (its epoch is the fit's last): the
    trained weights in a fresh model, the history and ledger as written, the best
    epoch's weights when ``keep_best`` asks for the rule that kept them."""
    model = build_model(trainer.model_factory, trainer.config.seed)
    model.load_state_dict(checkpoint.model_state)
    history = History.from_dict(checkpoint.history)
    history.info["sync"] = trainer.config.sync.describe()
    history.info["already_finished"] = {
        "epoch": checkpoint.epoch,
        "step": checkpoint.step,
        "checkpoint": str(store.path(checkpoint.step)),
    }
    best = None
    if keep_best is not None:
        best = BestWeights(keep_best, store, trainer.checkpoint_fingerprint)
        best.resume()  # best.pt, if the finished fit kept it under this rule
        if best.info() is not None:
            history.info["best"] = best.info()
    ledger = ledger_from_state(checkpoint.ledger) if checkpoint.ledger else None
    result = FitResult(
        model=model,
        history=history,
        ledger=ledger,
        best_model=best_model(trainer, best),
        ema_model=averaged_model(trainer, _checkpoint_average(trainer, model, checkpoint)),
    )
    if trainer.config.progress:
        print(result.summary())
    return result


def _checkpoint_average(trainer: Any, model: Any, checkpoint: Any) -> dict[str, Any] | None:
    """The weights' moving average (``ema_decay``) in the checkpoint's optimizer state:
    the optimizer the fit builds, on ``model`` (the checkpoint's weights), given it."""
    if not trainer.averages_weights:
        return None
    optimizer = build_optimizer(optimizer_factory(trainer.graph), model)
    optimizer.load_state_dict(checkpoint.optimizer_state)
    return averaged_state_dict(model, optimizer)
