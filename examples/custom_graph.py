"""Build the training graph by hand and add your own stage (gradient clipping).

The clipping stage sits between AllReduce and Update, so it sees the mean
gradient of the global batch, exactly as single-process training would.
"""

import argparse

import torch
import torch.nn.functional as F

import dataflow as dfl
from dataflow import stages
from dataflow.demo import FieldNet, random_fields


class ClipGradNorm(stages.Stage):
    """Clip the reduced gradient to ``max_norm`` and record its norm before clipping."""

    def __init__(self, max_norm: float) -> None:
        super().__init__("ClipGradNorm")
        if not max_norm > 0:
            raise dfl.ConfigError(f"ClipGradNorm(max_norm={max_norm}): must be > 0")
        self.max_norm = max_norm

    def run(self, step: stages.StepContext, grads: stages.Gradients) -> stages.Gradients:
        params = step.replica.model.parameters()
        step.metrics["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        return grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-norm", type=float, default=1.0)
    args = parser.parse_args()

    x, y = random_fields(2000, seed=0)
    g = dfl.Graph()
    batch = g.add(stages.Load(dfl.io.ArraySource(x, y)))
    out = g.add(stages.Forward(FieldNet, F.cross_entropy), batch)
    grads = g.add(stages.Backward(), out)
    reduced = g.add(stages.AllReduce(bucket_mb=25), grads)
    clipped = g.add(ClipGradNorm(args.max_norm), reduced)
    g.add(stages.Update(lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9)), clipped)
    print(g.to_dot())

    trainer = dfl.Trainer(g, schedule=dfl.schedule.Fixed(64), seed=0)
    for plan in trainer.plan(epochs=args.epochs, replicas=2, step_seconds=0.05):
        print(plan)
    result = trainer.fit(epochs=args.epochs)
    print("last loss:", result.history.steps[-1]["loss"])


if __name__ == "__main__":
    main()
