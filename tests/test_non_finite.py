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


class PoisonOnce(dfl.stages.Stage):
    """Test stage: a NaN in replica 0's batch at step ``step``, once per ``marker``."""

    def __init__(self, marker: str, step: int) -> None:
        super().__init__("PoisonOnce")
        self.marker, self.step = marker, step

    def run(self, step, batch):
        if step.spec.index == self.step and step.replica.rank == 0:
            from pathlib import Path

            if not Path(self.marker).exists():
                Path(self.marker).touch()
                batch.x = batch.x.clone()
                batch.x[0, 0, 0, 0] = float("nan")
        return batch


@pytest.mark.parametrize("check", ["step", "window"])
def test_rollback_goes_back_to_the_last_window_and_halves_the_lr(client, tmp_path, check):
    """``check="window"`` (a GPU's default): the verdict is read once per window, the
    bad window's updates are applied and then discarded by the rollback: same result."""
    from conftest import TinyCNN, sgd

    x, y = make_data(192)
    g = dfl.Graph()
    batch = g.add(dfl.stages.Load(dfl.io.ArraySource(x, y)))
    batch = g.add(PoisonOnce(str(tmp_path / "poisoned"), step=9), batch)
    out = g.add(dfl.stages.Forward(TinyCNN, torch.nn.functional.cross_entropy), batch)
    grads = g.add(dfl.stages.Backward(), out)
    reduced = g.add(dfl.stages.AllReduce(), grads)
    g.add(dfl.stages.Update(sgd, on_non_finite="rollback", check=check), reduced)
    trainer = dfl.Trainer(
        g, schedule=dfl.schedule.Fixed(16), progress=False, window_seconds=0.2, dry_run=False
    )
    result = trainer.fit(epochs=2, client=client)

    [event] = result.history.info["failures"]
    assert event["reason"] == "non-finite" and event["lr_factor"] == 0.5
    assert event["commit_step"] <= 9 and event["lost"] == []
    assert result.history.info["process_groups"] == 1  # rolled back in place, no new group
    assert "step 9" in event["error"]
    assert result.history.phases[0]["lr"] == pytest.approx(0.05 * 0.5)  # sgd's lr, halved
    steps = [s["step"] for s in result.history.steps]
    assert steps == list(range(len(steps)))  # each step once, the bad one replayed
    assert all(np.isfinite(s["loss"]) for s in result.history.steps)
    for epoch in (0, 1):
        assert result.ledger.summary()[epoch]["consumed"] == 192
    for tensor in result.model.state_dict().values():
        assert torch.isfinite(tensor).all()


def test_a_window_check_stops_the_fit_naming_the_step_and_refuses_skip(client):
    from conftest import TinyCNN, sgd

    x, y = data_with_a_nan()
    g = dfl.Graph()
    batch = g.add(dfl.stages.Load(dfl.io.ArraySource(x, y)))
    out = g.add(dfl.stages.Forward(TinyCNN, torch.nn.functional.cross_entropy), batch)
    reduced = g.add(dfl.stages.AllReduce(), g.add(dfl.stages.Backward(), out))
    g.add(dfl.stages.Update(sgd, check="window"), reduced)
    trainer = dfl.Trainer(g, schedule=dfl.schedule.Fixed(16), progress=False, dry_run=False)
    with pytest.raises(NonFiniteError, match=r"step \d+ \(phase 0\).*end of its window"):
        trainer.fit(epochs=1, client=client)
    with pytest.raises(ConfigError, match="check='window', on_non_finite='skip'"):
        dfl.stages.Update(sgd, check="window", on_non_finite="skip")
