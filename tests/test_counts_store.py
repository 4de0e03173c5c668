"""Counts stored narrow: int16 in an lz4 zarr store (half float32's bytes to read, decode
and copy to a GPU), scaled on the device by ``Transform(Log1p(dtype=torch.float32))``,
as CosmoFlow trains on log(1 + counts). The fit equals one on the float32 log fields
held in memory: the narrow store changes what is read, not what is trained."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TinyCNN, max_abs_diff, run_benchmark, tiny_pipeline

import dataflow as dfl

pytestmark = pytest.mark.slow  # two fits on the cluster; a benchmark's smoke run


def test_int16_counts_from_an_lz4_store_train_as_their_float32_log_in_memory(client, tmp_path):
    rng = np.random.default_rng(0)
    counts = rng.poisson(3.0, size=(96, 1, 8, 8)).astype(np.int16)
    y = rng.integers(0, 3, size=96).astype(np.int64)
    store = dfl.io.to_zarr(tmp_path / "counts.zarr", counts, y, compressor="lz4")
    source = dfl.io.ZarrSource(store, x="x", y="y", shuffle=False)  # (in index order, as
    wide = dfl.io.ArraySource(np.log1p(counts.astype(np.float32)), y, shuffle=False)  # this)
    log1p = dfl.ops.Log1p(dtype=torch.float32)
    narrow = tiny_pipeline(None, None, source=source, transforms=[log1p], seed=3)
    narrow_fit = narrow.fit(epochs=2, client=client)
    wide_fit = tiny_pipeline(None, None, source=wide, seed=3).fit(epochs=2, client=client)
    assert len(narrow_fit.history.steps) == len(wide_fit.history.steps) == 12
    assert max_abs_diff(narrow_fit.model, wide_fit.model) < 1e-5
    torch.manual_seed(3)
    assert max_abs_diff(narrow_fit.model, TinyCNN()) > 1e-3  # (it trained)


def test_the_codec_benchmark_runs_and_compares_with_the_default_store(tmp_path):
    """``benchmarks/bench_field_codecs.py --tiny``: every codec and dtype read, each
    against the default store (float32, zstd) at the same thread count."""
    run = run_benchmark(
        "bench_field_codecs.py", tmp_path / "codecs.json", "--tiny", "--threads", "1", timeout=120
    )
    cases = {(r["codec"], r["dtype"]) for r in run["results"]}
    assert cases == {(c, d) for c in ("zstd", "lz4") for d in ("float32", "int16", "float16")}
    for r in run["results"]:
        assert r["samples_per_s"] > 0 and r["compression"] > 0
        if (r["codec"], r["dtype"]) == ("zstd", "float32"):
            assert r["ratio_to_baseline"] == 1.0
