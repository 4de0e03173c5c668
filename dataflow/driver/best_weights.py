"""The weights of the fit's best epoch (``fit(keep_best=...)``), kept on the driver.

The machine has the replicas' states come back at the end of each epoch whose record
has the watched metric (``KeepIfBest``, after the epoch's last window committed); the
loop hands them here with the epoch's record. An epoch better than the kept one (by the
:class:`~dataflow.callbacks.KeepBest` rule) replaces it: in memory for
``result.best_model``, and in ``best.pt`` of the checkpoint folder when there is one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dataflow.callbacks import KeepBest
from dataflow.checkpoint.best import best_record, load_best, save_best
from dataflow.checkpoint.store import BEST_FILE


class BestWeights:
    """The best epoch so far by ``rule``, and its weights. ``store``: the fit's
    checkpoint store (None: kept in memory only); ``fingerprint``: the fit's, written
    with the file. ``held_out``: the held-out samples a whole evaluation scores (an
    epoch a lost worker left partly scored is no candidate)."""

    def __init__(
        self,
        rule: KeepBest,
        store: Any = None,
        fingerprint: Mapping[str, Any] | None = None,
        held_out: int | None = None,
    ) -> None:
        self.rule, self.store, self.held_out = rule, store, held_out
        self.fingerprint = dict(fingerprint or {})
        self.value: float | None = None
        self.epoch: int | None = None
        self.step: int | None = None
        self.model_state: dict[str, torch.Tensor] | None = None
        self.path: Path | None = None

    def resume(self) -> None:
        """A resumed fit: the best weights its earlier runs wrote are the bar to beat
        (same metric and mode; a file another rule wrote is replaced by the first epoch
        this fit scores)."""
        if self.store is None:
            return
        record = best_record(self.store, self.fingerprint)
        if record is None or (record["metric"], record["mode"]) != (
            self.rule.metric,
            self.rule.mode,
        ):
            return
        self.value, self.epoch, self.step = record["value"], record["epoch"], record["step"]
        self.path = self.store.directory / BEST_FILE

    def offer(self, record: Mapping[str, Any], step: int, states: Sequence[Any]) -> bool:
        """Keep the weights of ``states`` (each replica's, at the end of the epoch of
        ``record``) if its metric is the best so far. Returns whether it was."""
        value = record.get(self.rule.metric)
        scored = record.get("held_out_samples")
        if value is None or (
            self.held_out is not None and scored is not None and scored < self.held_out
        ):
            return False  # not measured, or partly (a lost worker's share unscored)
        value = float(value)
        if not self.rule.improves(value, self.value):
            return False
        self.value, self.epoch, self.step = value, int(record["epoch"]), step
        self.model_state = synchronized_weights(states)
        if self.store is not None:
            self.path = save_best(
                self.store,
                self.model_state,
                epoch=self.epoch,
                step=step,
                metric=self.rule.metric,
                mode=self.rule.mode,
                value=value,
                fingerprint=self.fingerprint,
            )
        return True

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The kept weights (read back from ``best.pt`` when an earlier run kept them)."""
        if self.model_state is None and self.path is not None:
            self.model_state = load_best(self.path.parent)["model_state"]
        return self.model_state

    def info(self) -> dict[str, Any] | None:
        """``history.info["best"]``: the kept epoch, or None before one."""
        if self.epoch is None:
            return None
        return {
            "metric": self.rule.metric,
            "mode": self.rule.mode,
            "epoch": self.epoch,
            "step": self.step,
            "value": self.value,
            "path": None if self.path is None else str(self.path),
        }


def synchronized_weights(states: Sequence[Any]) -> dict[str, torch.Tensor]:
    """The model a phase ending at these states would hold: rank 0's weights with each
    floating-point buffer (BatchNorm's running statistics, which drift apart between
    replicas inside a phase) the mean over the replicas, summed in rank order and
    divided as the phase end's allreduce does. ``states``: one per replica, or a tuple
    per replica (a spatial group's workers, whose buffers agree)."""
    leaders = [s[0] if isinstance(s, tuple) else s for s in states]
    parts = [p for s in states for p in (s if isinstance(s, tuple) else (s,))]
    owner = next((p for p in parts if p.model is not None), None)
    if owner is None:
        raise RuntimeError("no replica returned the weights for keep_best (a bug)")
    weights = dict(owner.model)
    for name, value in weights.items():
        mine = [(s.buffers or {}).get(name) for s in leaders]
        if not value.is_floating_point() or any(b is None for b in mine):
            continue  # a parameter, or an integer buffer (rank 0's, as at a phase end)
        total = mine[0].clone()
        for other in mine[1:]:
            total += other
        weights[name] = total.div_(len(mine))
    return weights
