"""Training with a spatial layout on a real LocalCluster (issue 16, items 1, 3, 7).

Two worker processes form one sample group: each reads its half of every sample,
the partitioned model exchanges halos over a real gloo group, and the weights after
20 steps equal single-process training on the same batches.
"""

import numpy as np
import pytest
import torch
from conftest import (
    TinyCNN,
    learnable_labels,
    make_data,
    max_abs_diff,
    reference_training,
    tiny_pipeline,
)

import dataflow as dfl

pytestmark = pytest.mark.slow


def test_spatial_two_equals_single_process_training(client):
    x, y = make_data(160)  # 5 steps of 32 per epoch, 4 epochs: 20 steps
    pipe = tiny_pipeline(x, y, batch=32, layout=dfl.Layout(spatial=2), bucket_mb=0.0005)
    result = pipe.fit(epochs=4, client=client)
    batches = tiny_pipeline(x, y, batch=32).sample_plan(epochs=4, replicas=1)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert len(result.history.steps) == 20
    assert result.history.info["replicas"] == 1
    assert result.history.phases[0]["local_batches"] == [32]
    assert max_abs_diff(result.model, expected) <= 1e-5
    assert isinstance(result.model, TinyCNN)  # the plain model comes back
    for epoch in range(4):  # every sample once per epoch, read by the group
        assert sorted(result.ledger.consumed(epoch).tolist()) == list(range(160))


def test_a_layer_that_cannot_be_partitioned_fails_before_the_fit(client):
    class Upsampling(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 2, 3)
            self.up = torch.nn.Upsample(scale_factor=2)
            self.head = torch.nn.Linear(2 * 12 * 12, 3)

        def forward(self, x):
            return self.head(self.up(self.conv(x)).flatten(1))

    x, y = make_data(32)
    pipe = tiny_pipeline(x, y, model=Upsampling, layout=dfl.Layout(spatial=2))
    with pytest.raises(dfl.ModelError, match="'up' \\(Upsample\\) cannot run on a region"):
        pipe.fit(epochs=1, client=client)


def test_spatial_fit_streams_each_workers_region_from_zarr(client, tmp_path):
    """The fit from a zarr store chunked along the split dimension (each worker reads
    only its half of every sample) equals single-process training on its batches."""
    x, y = make_data(64)
    store = dfl.io.to_zarr(tmp_path / "d.zarr", x, y, spatial_chunks={1: 4})
    source = dfl.io.ZarrSource(store, x="x", y="y")
    layout = dfl.Layout(spatial=2)
    result = tiny_pipeline(x, y, batch=16, source=source, layout=layout).fit(2, client)
    batches = tiny_pipeline(x, y, batch=16, source=source).sample_plan(epochs=2, replicas=1)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.model, expected) <= 1e-5


def test_adaptive_with_spatial_two_measures_what_one_process_measures(client):
    """The noise scale needs each replica's gradient, which the group's workers hold in
    parts: the measured pairs are summed over the group, so a spatial=2 Adaptive fit
    measures, grows the batch and scales the LR as one process does on the same data."""
    x, _ = make_data(192)
    y = learnable_labels(x)  # a learnable signal

    def fit(**options):
        schedule = dfl.schedule.Adaptive(8, max_batch=64, max_growth=2.0)
        pipe = tiny_pipeline(x, y, optimizer=plain_sgd, schedule=schedule, **options)
        return pipe.fit(epochs=4, client=client)

    spatial = fit(layout=dfl.Layout(spatial=2))
    single = fit(replicas=1)
    assert spatial.history.info["replicas"] == 1
    got, expected = spatial.history.phases, single.history.phases
    assert [p["global_batch"] for p in got] == [p["global_batch"] for p in expected]
    assert got[-1]["global_batch"] > got[0]["global_batch"]  # it measured, and grew
    for mine, theirs in zip(got, expected, strict=True):
        assert mine["micro_batches"] == theirs["micro_batches"] == [2]
        if theirs["measured_noise_scale"] is None:
            assert mine["measured_noise_scale"] is None
        else:
            assert mine["measured_noise_scale"] == pytest.approx(
                theirs["measured_noise_scale"], rel=1e-4
            )
    assert max_abs_diff(spatial.model, single.model) <= 1e-5


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.02)


class SegmentationCNN(torch.nn.Module):
    """Fully convolutional: a class per pixel of a 2-D window."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 3, 1)
        )

    def forward(self, x):
        return self.body(x)


def test_spatial_fit_on_patch_windows_equals_one_process(client, tmp_path):
    """PatchSource under Layout(spatial=2): each worker reads its half of every window
    (its units' boxes cut to the region), the partitioned model exchanges halos, the
    gathered per-pixel output meets the whole label window; the weights equal a
    one-process fit of the same windows, in the same order."""
    import zarr

    rng = np.random.default_rng(3)
    field = rng.normal(size=(48, 40)).astype(np.float32)
    labels = np.digitize(field, [-0.5, 0.5]).astype(np.int64)
    group = zarr.open_group(str(tmp_path / "f.zarr"), mode="w")
    for name, data in (("t", field), ("lab", labels)):
        array = group.create_array(name, shape=data.shape, chunks=(16, 16), dtype=data.dtype)
        array[...] = data
    source = dfl.io.PatchSource(tmp_path / "f.zarr", "t", "lab", patch={0: 12, 1: 8})
    assert source.num_samples == 20 and source.sample_shape == (1, 12, 8)

    def fit(**options):
        pipe = dfl.Pipeline(
            model=SegmentationCNN,
            device="cpu",
            loss=torch.nn.functional.cross_entropy,
            optimizer=plain_sgd,
            source=source,
            schedule=dfl.schedule.Fixed(4),
            progress=False,
            **options,
        )
        return pipe.fit(epochs=2, client=client)

    spatial = fit(layout=dfl.Layout(spatial=2))
    single = fit(replicas=1)
    assert spatial.history.info["replicas"] == 1
    assert len(spatial.history.steps) == len(single.history.steps) == 10
    assert [r.loss for r in spatial.history.steps] == pytest.approx(
        [r.loss for r in single.history.steps], rel=1e-5
    )
    assert max_abs_diff(spatial.model, single.model) <= 1e-5
    for epoch in range(2):
        assert sorted(spatial.ledger.consumed(epoch).tolist()) == list(range(20))


def test_spatial_two_under_a_decay_stopped_by_a_callback_equals_one_process(client):
    """Layout(spatial=2) meets the fit-level LR and the epoch callbacks: each rank of the
    group steps at the decayed LR, and a stop after epoch 1 of 4 ends the group's fit
    there, on the single process's weights for those 2 epochs at those LRs."""
    x, y = make_data(160)
    decay = dfl.schedule.CosineDecay(warmup_epochs=0.4, warmup_start=0.2, final=0.1)

    def stop_after_one(epoch, history):
        if epoch["epoch"] == 1:
            raise dfl.StopTraining("two epochs")

    options = dict(batch=32, lr_decay=decay, bucket_mb=0.0005)
    pipe = tiny_pipeline(x, y, layout=dfl.Layout(spatial=2), **options)
    result = pipe.fit(epochs=4, client=client, on_epoch=stop_after_one)
    assert [e["epoch"] for e in result.history.epochs] == [0, 1]
    specs = [s for plan in tiny_pipeline(x, y, **options).plan(4, 1) for s in plan.steps][:10]
    lrs = [0.05 * decay.factor(s.epoch + s.start / 160, 4) for s in specs]
    assert [s["lr"] for s in result.history.steps] == pytest.approx(lrs, rel=1e-12)
    batches = tiny_pipeline(x, y, batch=32).sample_plan(epochs=2, replicas=1)
    expected = reference_training(x, y, batches=batches, seed=0, lrs=lrs)
    assert max_abs_diff(result.model, expected) <= 1e-5


@pytest.mark.slow
def test_spatial_two_keeps_the_best_epochs_weights_of_the_group(client):
    """Layout(spatial=2) meets keep_best: the group's workers return their parts at each
    epoch's end, and the kept weights are the single process's after the best epoch."""
    x, y = make_data(160)
    pipe = tiny_pipeline(x, y, batch=32, layout=dfl.Layout(spatial=2), bucket_mb=0.0005)
    result = pipe.fit(epochs=3, client=client, keep_best="train_loss")
    losses = [e["train_loss"] for e in result.history.epochs]
    best = min(range(3), key=losses.__getitem__)
    assert result.history.info["best"]["epoch"] == best
    batches = tiny_pipeline(x, y, batch=32).sample_plan(epochs=best + 1, replicas=1)
    expected = reference_training(x, y, batches=batches, seed=0)
    assert max_abs_diff(result.best_model, expected) <= 1e-5
