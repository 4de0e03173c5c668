"""PatchSource windows meet the rest of a fit: a growing batch, unequal shares, another
sync policy, bf16, an evaluation (issue 36: everything the engine does for ZarrSource
holds for windows)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_patch_source import precut, seg_pipeline, tiles, write_2d

import dataflow as dfl

pytestmark = pytest.mark.slow  # real worker processes


def test_a_growing_batch_with_unequal_shares_trains_windows_as_the_windows_cut_by_hand(
    client, tmp_path
):
    """Stepwise 8 -> 16 split 1:3 between the replicas: the windows, unshuffled, train
    exactly as the same windows pre-cut into an ArraySource in C order."""
    path, data = write_2d(tmp_path)
    source = tiles(path, shuffle=False)
    x = np.stack([precut(data[k], source.corners, (8, 8), (0, 1)) for k in "ab"], 1)
    y = precut(data["lab"], source.corners, (8, 8), (0, 1))
    options = dict(
        schedule=dfl.schedule.Stepwise({0: 8, 1: 16}, lr_scaling="linear"),
        balancer=dfl.balance.Proportional((1, 3)),
    )
    windows = seg_pipeline(source, **options).fit(epochs=2, client=client)
    by_hand = seg_pipeline(dfl.io.ArraySource(x, y, shuffle=False), **options).fit(
        epochs=2, client=client
    )
    phases = windows.history.phases
    assert [(p["global_batch"], p["local_batches"]) for p in phases] == [(8, [2, 6]), (16, [4, 12])]
    for name, tensor in by_hand.model.state_dict().items():
        assert torch.allclose(windows.model.state_dict()[name], tensor, atol=1e-6), name
    for epoch in range(2):
        assert windows.ledger.consumed(epoch).tolist() == list(range(source.num_samples))
        share = len(windows.ledger.consumed(epoch, 1)) / source.num_samples
        assert share == pytest.approx(0.75, abs=0.06)  # the 3 of 1:3, to a step's rounding


def test_shuffled_windows_under_local_updates_in_bf16_with_an_evaluation(client, tmp_path):
    path, _ = write_2d(tmp_path)
    source = tiles(path)
    corners = [[0, 0], [16, 8], [40, 32], [56, 40]]
    held_out = tiles(path, shuffle=False, windows=corners, stride=None)
    pipe = seg_pipeline(
        source,
        eval_source=held_out,
        sync=dfl.sync.Local(period_steps=2),
        precision="bf16",
    )
    result = pipe.fit(epochs=2, client=client)
    for epoch in range(2):
        assert result.ledger.consumed(epoch).tolist() == list(range(source.num_samples))
    assert [e["held_out_samples"] for e in result.history.epochs] == [4, 4]
    assert all(math.isfinite(e["eval_loss"]) for e in result.history.epochs)
    assert all(math.isfinite(s["loss"]) for s in result.history.steps)
