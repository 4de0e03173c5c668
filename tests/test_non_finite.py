"""A NaN in the data: caught before the update, then either stop or drop the step."""

import numpy as np
import pytest
import torch
from conftest import make_data, tiny_pipeline

import dataflow as dfl
from dataflow.errors import ConfigError, NonFiniteError

pytestmark = pytest.mark.slow


def data_with_a_nan(n=64, bad=37):
    x, y = make_data(n)
    x[bad, 0, 3, 3] = np.nan
    return x, y


def test_a_nan_stops_the_fit_before_the_update_and_names_the_step(client):
    x, y = data_with_a_nan()
    pipe = tiny_pipeline(x, y, dry_run=False)
    with pytest.raises(NonFiniteError, match=r"step \d+ \(epoch 0, phase 0\).*no update"):
        pipe.fit(epochs=1, client=client)


def test_skip_drops_only_the_poisoned_steps_and_trains_on(client):
    x, y = data_with_a_nan()
    pipe = tiny_pipeline(x, y, on_non_finite="skip")
    result = pipe.fit(epochs=2, client=client)
    assert result.history.phases[0]["skipped_steps"] == 2  # one step per epoch holds it
    skipped = [s for s in result.history.steps if not np.isfinite(s["loss"])]
    assert len(skipped) == 2
    for tensor in result.model.state_dict().values():
        assert torch.isfinite(tensor).all()
    assert all(np.isfinite(e["train_loss"]) for e in result.history.epochs)


def test_an_unknown_policy_is_refused():
    x, y = make_data(16)
    with pytest.raises(ConfigError, match="on_non_finite"):
        tiny_pipeline(x, y, on_non_finite="ignore")
    assert issubclass(dfl.NonFiniteError, FloatingPointError)
