"""Class labels the model has no class for, named where they are: the sample's index in
the source, the value, the valid range and the source (the zarr store and array).

The dry run learns what a valid label is and checks its own samples; ``Load`` checks every
batch as it is read on a worker. ``train_in_process`` runs a worker's side of a one-replica
fit here, on the graph as a worker receives it (pickled after the dry run), so the labels
read past the dry run are checked without a cluster; the last test crosses one (slow).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyCNN, make_data, tiny_pipeline
from distributed import Client

import dataflow as dfl
from dataflow.io.labels import LabelCheck, label_check_for
from dataflow.runtime.replica import ReplicaRuntime, ReplicaSpec
from dataflow.stages.base import PhaseContext
from dataflow.stages.forward import compute_loss

BAD = 137  # read past the dry run's two samples (the error comes from Load)


def train_in_process(pipe: dfl.Pipeline, epochs: int = 1) -> None:
    """The dry run, then one replica's worker side of every step of the fit, here."""
    trainer = pipe.trainer
    trainer._dry_run()
    graph = cloudpickle.loads(cloudpickle.dumps(trainer.graph))  # what a worker receives
    steps = tuple(step for plan in trainer.plan(epochs, 1) for step in plan.steps)
    order = graph.validate(replicas=1)
    seed = trainer.config.seed
    spec = ReplicaSpec(run_id="t", graph=graph, order=order, seed=seed, device="cpu")
    runtime = ReplicaRuntime(spec, rank=0, world_size=1, collective=None)
    try:
        runtime.begin_phase(PhaseContext(index=0, steps=steps, lr=None))
        runtime.run_window(steps[0].index, steps[-1].index + 1)
    finally:
        runtime.close()


def source(kind: str, x: np.ndarray, y: np.ndarray, tmp_path: Path) -> Any:
    if kind == "array":
        return dfl.io.ArraySource(x, y)
    path = dfl.io.to_zarr(tmp_path / "train.zarr", x, y, y_name="label", chunk_mb=16 * 256 / 1e6)
    return dfl.io.ZarrSource(path, x="x", y="label")


WHERE = {
    "array": r"y of ArraySource\(x=\(160, 1, 8, 8\), y=\(160,\), shuffle=True\)",
    "zarr": r"array 'label' of the zarr store '.*train\.zarr'",
}


@pytest.mark.parametrize("kind", ["array", "zarr"])
def test_a_bad_label_past_the_dry_run_is_named_as_it_is_read(kind: str, tmp_path: Path) -> None:
    x, y = make_data(160)
    y[BAD] = 7
    pipe = tiny_pipeline(x, y, source=source(kind, x, y, tmp_path))
    with pytest.raises(dfl.io.LabelError) as info:
        train_in_process(pipe)
    error = info.value
    assert isinstance(error, dfl.DataError)
    expected = (
        rf"^label 7 of sample {BAD} in {WHERE[kind]} is not a class of the model: valid labels "
        r"are 0 to 2 \(the model's output has 3 classes along dimension 1\), or -100 \(which "
        rf"the loss ignores\); fix the label at the source \(relabel or drop sample {BAD}\), "
        r"or, if the data has 8 or more classes, give the model that many outputs"
    )
    assert re.search(expected, str(error)), str(error)
    assert (error.index, error.value, error.classes) == (BAD, 7, 3)
    if kind == "zarr":  # read batch by batch: named as Load reads it
        assert any(
            note.startswith("in stage 'Load' on replica 0, step ") for note in error.__notes__
        )
    else:  # in memory: every label checked by the dry run, before any worker is asked
        assert error.__notes__ == ["in the dry run: every label of the in-memory source, checked"]


def test_the_dry_run_names_a_bad_label_among_its_own_samples() -> None:
    x, y = make_data(160)
    y[:] = -1  # negative: the fix is the ignore index, not more classes
    with pytest.raises(dfl.io.LabelError, match=r"^label -1 of sample \d+ in y of") as info:
        tiny_pipeline(x, y).trainer._dry_run()
    assert "give it the loss's ignore_index (-100 for torch's cross_entropy" in str(info.value)
    assert info.value.__notes__ == ["in stage 'Forward' on replica 0, step 0"]


def test_several_bad_labels_of_a_batch_are_listed() -> None:
    check = label_check_for(
        F.cross_entropy, torch.zeros(4, 3), torch.zeros(4, dtype=torch.long), "y"
    )
    assert check is not None
    with pytest.raises(
        dfl.io.LabelError, match=r"^label 3 of sample 11 .* same batch with such labels: 13\.$"
    ):
        check.check(torch.tensor([0, 3, 2, 5]), np.array([10, 11, 12, 13]))
    check.check(torch.tensor([0, 1, 2, -100]), None)  # the loss ignores -100
    check.check(torch.zeros(0, dtype=torch.long), np.array([], dtype=np.int64))  # no samples


@pytest.mark.parametrize("kind", ["array", "zarr"])
def test_float_class_labels_name_the_source_and_the_cast(kind: str, tmp_path: Path) -> None:
    """torch says only 'expected target dtype to be Long or Byte, but got Float'."""
    x, y = make_data(160)
    pipe = tiny_pipeline(x, y, source=source(kind, x, y.astype(np.float32), tmp_path))
    expected = (
        rf"^loss function 'cross_entropy' takes class labels as integers, but {WHERE[kind]} "
        r"holds float32 labels of shape \(2,\); cast them to int64 where they are made: "
        r"ArraySource\(x, y.astype\('int64'\)\) .* or in the loss: loss=lambda out, y: "
        r"F.cross_entropy\(out, y.long\(\)\). torch said: expected target dtype"
    )
    with pytest.raises(dfl.LossError, match=expected) as info:
        pipe.trainer._dry_run()
    assert info.value.__notes__ == ["in stage 'Forward' on replica 0, step 0"]
    # without the dry run (a worker's step), the loss call still names the labels' dtype
    with pytest.raises(dfl.LossError, match=r"^loss function 'CrossEntropyLoss' .* but y \(the "
                       r"source's targets\) holds float64 labels .* torch.nn.CrossEntropyLoss\(\)"
                       r"\(out, y.long\(\)\)"):  # fmt: skip
        compute_loss(torch.nn.CrossEntropyLoss(), torch.zeros(4, 3), torch.zeros(4).double())
    # the cast the message gives trains; class probabilities (float, shaped like the
    # output) are no class labels and train as they are
    train_in_process(tiny_pipeline(x, y, loss=lambda out, t: F.cross_entropy(out, t.long())))
    soft = np.eye(3, dtype=np.float32)[y]
    train_in_process(tiny_pipeline(x, soft))


# -- labels the loss takes are let through ---------------------------------------------


def test_the_ignore_index_of_cross_entropy_passes() -> None:
    x, y = make_data(160)
    y[::7] = -100
    train_in_process(tiny_pipeline(x, y))


def test_a_loss_with_another_ignore_index_lets_it_through() -> None:
    x, y = make_data(160)
    y[3::5] = 255  # segmentation's usual "void" label
    train_in_process(tiny_pipeline(x, y, loss=torch.nn.CrossEntropyLoss(ignore_index=255)))
    y[BAD] = 254
    pipe = tiny_pipeline(x, y, loss=lambda out, t: F.cross_entropy(out, t, ignore_index=255))
    with pytest.raises(dfl.io.LabelError, match=rf"^label 254 of sample {BAD} .* or 255 \(which"):
        train_in_process(pipe)


def ordinal_loss(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """K - 1 logits for K ordered levels (labels 0 .. K - 1): y may equal output.shape[1]."""
    levels = torch.arange(output.shape[1]) < y[:, None]
    return F.binary_cross_entropy_with_logits(output, levels.float())


def test_targets_that_are_no_class_indices_are_not_checked() -> None:
    logits, labels = torch.zeros(4, 3), torch.tensor([0, 1, 2, 3])
    assert label_check_for(ordinal_loss, logits, labels, "y") is None  # takes label 3
    assert label_check_for(F.mse_loss, logits, torch.zeros(4, 3), "y") is None  # float targets
    assert label_check_for(F.cross_entropy, logits, labels.bool(), "y") is None
    assert label_check_for(F.cross_entropy, torch.zeros(4), labels, "y") is None  # no classes
    x, y = make_data(160)
    y[BAD] = 3  # the ordinal loss's top level, with a model of 3 outputs
    train_in_process(tiny_pipeline(x, y, loss=ordinal_loss))


def test_a_label_per_pixel_is_named_with_its_position() -> None:
    output, y = torch.zeros(2, 4, 3, 3), torch.zeros(2, 3, 3, dtype=torch.long)
    check = label_check_for(F.cross_entropy, output, y, "array 'mask' of the zarr store 's'")
    assert isinstance(check, LabelCheck) and check.classes == 4
    y[1, 2, 0] = 9
    with pytest.raises(
        dfl.io.LabelError,
        match=r"^label 9 of sample 41 \(label position \(2, 0\)\) in array 'mask' of the zarr",
    ):
        check.check(y, np.array([40, 41]))


# -- inputs the model cannot take ------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int64, np.uint8, np.bool_])
def test_integer_inputs_are_named_like_float64_ones(dtype: type) -> None:
    x, y = make_data(64)
    want = np.dtype(dtype).name if dtype is not np.bool_ else "bool"
    with pytest.raises(dfl.DataError, match=rf"^x is {want} but the model's parameters are ") as e:
        tiny_pipeline(x.astype(dtype), y).trainer._dry_run()
    counts = "transforms=[dataflow.ops.Log1p(dtype=torch.float32)]"
    assert (counts in str(e.value)) == (dtype is np.int64)  # counts, not images or masks


def test_a_model_that_casts_integer_inputs_trains() -> None:
    class Casting(TinyCNN):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.float() / 255)

    x, y = make_data(64)
    tiny_pipeline((x * 50).clip(0, 255).astype(np.uint8), y, model=Casting).trainer._dry_run()


def test_a_meta_model_materialised_as_the_error_says_trains() -> None:
    def materialised() -> torch.nn.Module:
        with torch.device("meta"):
            model = TinyCNN()
        model.to_empty(device="cpu")
        for layer in model.modules():
            if hasattr(layer, "reset_parameters"):
                layer.reset_parameters()
        return model

    x, y = make_data(64)
    tiny_pipeline(x, y, model=materialised).trainer._dry_run()
    with pytest.raises(dfl.ConfigError, match=r"built the model on the meta device"):
        tiny_pipeline(x, y, model=TinyCNN().to("meta")).trainer._dry_run()  # an instance


# -- on a cluster ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_bad_label_fails_the_fit_once_naming_the_sample_and_the_store(
    client: Client, tmp_path: Path
) -> None:
    x, y = make_data(160)
    y[BAD] = 7
    pipe = tiny_pipeline(x, y, source=source("zarr", x, y, tmp_path), replicas=2)
    with pytest.raises(dfl.io.LabelError, match=rf"^label 7 of sample {BAD} in {WHERE['zarr']}"):
        pipe.fit(1, client=client)
    y[BAD] = 2  # the workers are free again: the fit runs once the label is fixed
    result = tiny_pipeline(x, y, source=source("zarr", x, y, tmp_path), replicas=2).fit(
        1, client=client
    )
    assert len(result.history.steps) == 10
