"""Train a small CNN data-parallel on a local Dask cluster (or yours, with --scheduler).

python examples/quickstart.py                     # embedded LocalCluster
python examples/quickstart.py --scheduler tcp://head-node:8786
"""

import argparse

import torch
import torch.nn.functional as F

import dataflow as dfl
from dataflow.tools.demo import FieldNet, random_fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", help="address of a running Dask scheduler")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    x, y = random_fields(3000, seed=0)  # numpy arrays: (3000, 1, 32, 32) and (3000,)
    pipe = dfl.Pipeline(
        model=FieldNet,  # a factory: called once per replica
        loss=F.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9),
        source=dfl.io.ArraySource(x[:2500], y[:2500]),
        eval_source=dfl.io.ArraySource(x[2500:], y[2500:], shuffle=False),
        metrics={"accuracy": dfl.stages.accuracy},
        schedule=dfl.schedule.Fixed(batch_size=64),
        seed=0,
    )
    client = None
    if args.scheduler:
        from distributed import Client

        client = Client(args.scheduler)
    # keep_best: result.best_model holds the weights of the most accurate epoch
    result = pipe.fit(epochs=args.epochs, client=client, keep_best="eval_accuracy")
    result.history.to_json("runs/quickstart/history.json")
    best = result.history.info["best"]
    print(f"best held-out accuracy {best['value']:.1%} after epoch {best['epoch']}")
    last = result.history.epochs[-1]
    print(f"final held-out accuracy {last['eval_accuracy']:.1%}, loss {last['eval_loss']:.3f}")


if __name__ == "__main__":
    main()
