"""Backward: gradients of the local mean loss (the allreduce weights them by b_r / B)."""

from __future__ import annotations

from dataflow.stages.base import ForwardOutput, Gradients, Stage, StepContext


class Backward(Stage):
    """``loss.backward()``; with micro-batches, once per micro-batch (gradients accumulate).
    In fp16 the loss is multiplied by the replica's loss scale first, so small gradients
    do not flush to zero in fp16; the allreduce divides the scale out."""

    per_micro_batch = True

    def run(self, step: StepContext, out: ForwardOutput) -> Gradients:
        if out.loss is not None and not out.captured:  # (a replay computed them already)
            scale = step.replica.loss_scale  # fp16: AllReduce divides it out again
            (out.loss if scale is None else out.loss * scale.scale).backward()
        elif out.participation is not None and out.participation.requires_grad:
            out.participation.backward()  # sync_batchnorm, no samples: the peers' reductions
        return Gradients(samples=out.batch.size)
