"""A ``Pipeline`` made without optimizer, source and schedule: it evaluates and predicts
with a trained model (in a later script, from weights on disk), as the training
pipeline does, and refuses to train with an error saying what to give."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import zarr
from conftest import TinyCNN
from test_evaluate_model import pipeline, write_test_set

import dataflow as dfl


def inference_pipeline(**options) -> dfl.Pipeline:
    """The training pipeline's model, loss and transforms; nothing to train with."""
    return dfl.Pipeline(
        model=TinyCNN,
        loss=F.cross_entropy,
        transforms=[dfl.ops.Log1p(), dfl.ops.RandomFlip(axes=(2, 3))],
        **{"device": "cpu", **options},
    )


def test_it_scores_and_predicts_as_the_training_pipeline_does(tmp_path):
    path = write_test_set(tmp_path)
    test = dfl.io.ZarrSource(path, x="x", y="y", shuffle=False)
    torch.manual_seed(0)
    model = TinyCNN()
    accuracy = {"accuracy": lambda out, y: (out.argmax(1) == y).float().mean()}
    trained, later = pipeline(test, metrics=None), inference_pipeline(metrics=None)
    assert later.evaluate(test, model) == trained.evaluate(test, model)
    assert later.evaluate(test, model, metrics=accuracy) == trained.evaluate(
        test, model, metrics=accuracy
    )
    written = [
        zarr.open_group(p.predict(test, model, tmp_path / f"{k}.zarr"), mode="r")["prediction"][:]
        for k, p in (("trained", trained), ("later", later))
    ]
    np.testing.assert_array_equal(written[0], written[1])


def test_the_random_transforms_stay_out_and_the_metrics_count():
    later = inference_pipeline(metrics={"top": lambda out, y: out.max(1).values.mean()})
    assert [type(t.config.fn).__name__ for t in later._eval_transforms] == ["Log1p"]
    assert set(later.eval_metrics) == {"loss", "top"}


@pytest.mark.parametrize("call", ["fit", "plan", "sample_plan"])
def test_it_refuses_to_train_saying_what_to_give(call):
    later = inference_pipeline()
    args = {"fit": (1,), "plan": (1, 1), "sample_plan": (1, 1)}[call]
    with pytest.raises(
        dfl.ConfigError,
        match=rf"^Pipeline\.{call} needs a pipeline made to train: this one was made without "
        r"optimizer=, source= and schedule=",
    ):
        getattr(later, call)(*args)


def test_a_training_pipeline_missing_one_part_is_named_at_construction():
    x = np.zeros((8, 1, 8, 8), np.float32)
    source = dfl.io.ArraySource(x, np.zeros(8, np.int64))
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    parts = {"optimizer": sgd, "source": source, "schedule": dfl.schedule.Fixed(4)}
    for left_out in parts:
        given = {k: v for k, v in parts.items() if k != left_out}
        with pytest.raises(dfl.ConfigError, match=rf"\(missing: {left_out}=;"):
            dfl.Pipeline(model=TinyCNN, loss=F.cross_entropy, **given)


def test_options_are_still_checked_without_training_parts():
    with pytest.raises(dfl.ConfigError, match="device must be"):
        inference_pipeline(device="gpu")
    with pytest.raises(dfl.ConfigError, match="expected a model class or factory"):
        dfl.Pipeline(model=3, loss=F.cross_entropy)
    with pytest.raises(dfl.ConfigError, match=r"eval_source=\.\.\.\) is scored during a fit"):
        inference_pipeline(eval_source=dfl.io.ArraySource(np.zeros((4, 1, 8, 8), np.float32)))
