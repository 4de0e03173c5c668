"""SampleLedger.record_spans: a whole window of every replica at once, a repeat refused
whether it comes within the window or across windows."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.core.errors import DataError
from dataflow.io.ledger import SampleLedger


def streams(replicas: int, per_replica: int, seed: int = 0):
    n = replicas * per_replica
    flat = np.random.default_rng(seed).permutation(n)
    bounds = np.arange(0, n + 1, per_replica)
    return n, flat, bounds


def test_spans_record_each_replicas_prefix_and_refuse_a_window_given_twice():
    n, flat, bounds = streams(4, 6)
    ledger = SampleLedger(n)
    for k in range(3):  # three windows of 2 samples per replica
        start, stop = np.full(4, 2 * k), np.full(4, 2 * k + 2)
        positions = ledger.record_spans(0, flat, bounds, start, stop)
        assert sorted(flat[positions].tolist()) == sorted(
            flat[bounds[r] + 2 * k + j] for r in range(4) for j in range(2)
        )
    assert ledger.consumed(0).tolist() == list(range(n))
    assert ledger.consumed(0, 2).tolist() == sorted(flat[12:18].tolist())
    with pytest.raises(DataError, match="consumed twice in epoch 0"):
        ledger.record_spans(0, flat, bounds, np.zeros(4, int), np.full(4, 2))


def test_streams_that_repeat_a_sample_are_refused_within_one_window():
    n, flat, bounds = streams(2, 4)
    flat = flat.copy()
    flat[5] = flat[1]  # replica 1's second sample is replica 0's second
    ledger = SampleLedger(n)
    with pytest.raises(DataError, match=rf"sample {flat[1]} consumed twice"):
        ledger.record_spans(0, flat, bounds, np.zeros(2, int), np.full(2, 2))


def test_a_span_outside_its_stream_is_refused():
    n, flat, bounds = streams(2, 4)
    ledger = SampleLedger(n)
    with pytest.raises(DataError, match="leaves its epoch stream"):  # into replica 1's
        ledger.record_spans(0, flat, bounds, np.array([2, 0]), np.array([6, 1]))
    with pytest.raises(DataError, match="leaves its epoch stream"):
        ledger.record_spans(0, flat, bounds, np.array([2, 0]), np.array([1, 1]))
