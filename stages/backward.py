"""Backward: gradients of the local mean loss (the allreduce weights them by b_r / B)."""

from __future__ import annotations

from dataflow.stages.base import ForwardOutput, Gradients, Stage, StepContext


class Backward(Stage):
    """``loss.backward()``; with micro-batches, once per micro-batch (gradients accumulate)."""

    per_micro_batch = True

    def run(self, step: StepContext, out: ForwardOutput) -> Gradients:
        if out.loss is not None:
            out.loss.backward()
        return Gradients(samples=out.batch.size)
