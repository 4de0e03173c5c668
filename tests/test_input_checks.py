"""The input checks behind the bad-input catalogue's newer rows: each fires on the mistake
and stays silent on the correct inputs that look like it (no false alarms).

The catalogue (tests/test_error_catalogue.py) asserts each mistake's error; here: what the
checks must let through, and the forms of ``client`` that ``fit`` accepts.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import zarr
from conftest import TinyCNN, make_data, tiny_pipeline
from distributed import Client

import dataflow as dfl
from dataflow.runtime.cluster import client_or_local_cluster
from dataflow.stages.forward import compute_loss, dtype_mismatch

# -- loss shapes -------------------------------------------------------------------


def test_broadcasting_shapes_are_refused_in_either_order() -> None:
    a, b = torch.zeros(5, 1), torch.zeros(5)
    for output, y in ((a, b), (b, a)):
        with pytest.raises(dfl.LossError, match=r"they broadcast to \(5, 5\)"):
            compute_loss(F.mse_loss, output, y)
    with pytest.raises(dfl.LossError, match="'l1_loss' got an output of shape"):
        compute_loss(F.l1_loss, a, b)
    with pytest.raises(dfl.LossError, match="'MSELoss' got an output of shape"):
        compute_loss(torch.nn.MSELoss(), a, b)


def test_shapes_that_differ_legitimately_pass() -> None:
    logits, labels = torch.randn(4, 4), torch.tensor([0, 1, 2, 3])  # classes == batch size
    expected = F.cross_entropy(logits, labels)
    assert torch.equal(compute_loss(F.cross_entropy, logits, labels), expected)
    one_class = torch.randn(4, 1)  # (N, 1) against (N,) labels: cross entropy does not warn
    compute_loss(F.cross_entropy, one_class, torch.zeros(4, dtype=torch.long))

    def squeezing_mse(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output.squeeze(-1), y)  # reshapes itself: no broadcast

    out, y = torch.randn(4, 1), torch.randn(4)
    assert torch.equal(compute_loss(squeezing_mse, out, y), F.mse_loss(out[:, 0], y))
    assert torch.equal(compute_loss(F.mse_loss, out, y[:, None]), F.mse_loss(out, y[:, None]))


class TwoHeads(TinyCNN):
    """A model whose forward returns (logits, features), as many classifiers do."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(x), x.flatten(1)


def test_a_model_returning_a_tuple_is_named_and_a_loss_that_takes_it_trains() -> None:
    """torch said only "cross_entropy_loss(): argument 'input' must be Tensor, not tuple"."""
    x, y = make_data(64)
    expected = (
        r"^the model's forward returned a tuple of 2 \(Tensor \(2, 3\), Tensor \(2, 64\)\), "
        r"which loss function 'cross_entropy' cannot take: it needs a tensor. Return the "
        r"tensor the loss compares with y from the model's forward, or pick it in the loss: "
        r"loss=lambda out, y: F.cross_entropy\(out\[0\], y\). torch said: cross_entropy_loss"
    )
    with pytest.raises(dfl.ModelError, match=expected) as info:
        tiny_pipeline(x, y, model=TwoHeads).trainer._dry_run()
    assert info.value.__notes__ == ["in stage 'Forward' on replica 0, step 0"]
    with pytest.raises(dfl.ModelError, match=r"returned a dict with keys \['logits'\].*"
                       r"F.mse_loss\(out\['logits'\], y\)"):  # fmt: skip
        compute_loss(F.mse_loss, {"logits": torch.zeros(2, 3)}, torch.zeros(2, 3))
    # a loss that takes the tuple (as the message says) trains; one that fails on it for
    # its own reason keeps its own error
    tiny_pipeline(
        x, y, model=TwoHeads, loss=lambda out, t: F.cross_entropy(out[0], t)
    ).trainer._dry_run()

    def failing(out: tuple[torch.Tensor, ...], t: torch.Tensor) -> torch.Tensor:
        raise ValueError("my loss refuses this batch")

    with pytest.raises(ValueError, match=r"^my loss refuses this batch$"):
        compute_loss(failing, (torch.zeros(2, 3),), torch.zeros(2))


def test_other_warnings_of_the_loss_still_reach_the_user() -> None:
    def noisy(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        warnings.warn("my loss is experimental", UserWarning, stacklevel=1)
        return (output.squeeze(-1) - y).pow(2).mean()

    with pytest.warns(UserWarning, match="my loss is experimental"):
        compute_loss(noisy, torch.zeros(3, 1), torch.zeros(3))


def test_a_loss_that_needs_targets_is_told_apart_from_one_that_fails() -> None:
    with pytest.raises(dfl.LossError, match="'CrossEntropyLoss' needs targets"):
        compute_loss(torch.nn.CrossEntropyLoss(), torch.randn(2, 3), None)

    def broken(output: torch.Tensor) -> torch.Tensor:
        raise TypeError("a bug inside the loss")

    with pytest.raises(TypeError, match="a bug inside the loss") as info:
        compute_loss(broken, torch.randn(2, 3), None)
    assert type(info.value) is TypeError  # the user's own error, unchanged
    assert compute_loss(lambda out: out.pow(2).mean(), torch.ones(2, 3), None) == 1.0


# -- dtypes ------------------------------------------------------------------------


def test_dtype_mismatch_names_the_input() -> None:
    model = TinyCNN()
    assert dtype_mismatch(model, torch.zeros(2, 1, 8, 8)) is None
    uint8 = torch.zeros(2, 1, 8, 8, dtype=torch.uint8)
    assert dtype_mismatch(model, uint8).startswith("x is uint8 but the model's parameters are")
    # an integer input is named only when torch's error is about types: a model may take
    # integers itself (an embedding) and fail for another reason
    shapes = RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x64 and 32x3)")
    assert dtype_mismatch(model, uint8, shapes) is None
    types = RuntimeError("Input type (unsigned char) and bias type (float) should be the same")
    assert dtype_mismatch(model, uint8, types).startswith("x is uint8")
    both = (torch.zeros(2, 1), torch.zeros(2, 1, dtype=torch.float64))
    assert dtype_mismatch(model, both).startswith("x[1] is float64 but the model's parameters")


def test_a_model_that_casts_its_input_trains_on_float64_data() -> None:
    class Casting(TinyCNN):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.float())

    x, y = make_data(64)
    pipe = tiny_pipeline(x.astype(np.float64), y, model=Casting)
    pipe.trainer._dry_run()  # no DataError: the model copes with float64 itself


# -- zarr metadata ---------------------------------------------------------------------


def _store(tmp_path: Path, zarr_format: int = 3) -> Path:
    x, y = make_data(16)
    group = zarr.open_group(tmp_path / "s.zarr", mode="w", zarr_format=zarr_format)
    group.create_array("x", data=x, chunks=(4, 1, 8, 8))
    group.create_array("y", data=y, chunks=(4,))
    return tmp_path / "s.zarr"


@pytest.mark.parametrize(
    ("zarr_format", "damaged", "content", "problem"),
    [
        (3, "zarr.json", "{not json", "not valid JSON"),
        (3, "x/zarr.json", "[]", "a JSON list, not an object"),
        (2, ".zgroup", "", "not valid JSON"),
        (2, "x/.zarray", '{"zarr_format": 2}', r"the key\(s\) \['shape', 'chunks', 'dtype'\]"),
        (2, "y/.zattrs", b"\xff\xfe", "not valid JSON"),
    ],
)
def test_damaged_metadata_is_named(
    tmp_path: Path, zarr_format: int, damaged: str, content: str | bytes, problem: str
) -> None:
    store = _store(tmp_path, zarr_format)
    target = store / damaged
    target.write_bytes(content if isinstance(content, bytes) else content.encode())
    expected = rf"metadata file {re.escape(str(target))} is corrupt: {problem}"
    with pytest.raises(dfl.DataError, match=expected):
        dfl.io.ZarrSource(store, "x", "y")


def test_damaged_metadata_is_named_for_an_opened_group(tmp_path: Path) -> None:
    store = _store(tmp_path)
    group = zarr.open_group(store, mode="r")
    (store / "y" / "zarr.json").write_text("{")
    with pytest.raises(dfl.DataError, match=r"s\.zarr/y/zarr\.json is corrupt"):
        dfl.io.ZarrSource(group, "x", "y")


def test_a_misspelled_name_in_a_sound_store_is_still_not_found(tmp_path: Path) -> None:
    with pytest.raises(dfl.io.VariableNotFoundError, match="no array 'label'"):
        dfl.io.ZarrSource(_store(tmp_path), "x", "label")


# -- what fit accepts as its client ---------------------------------------------------


def _clients(client: Client) -> set[str]:
    return set(client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.clients)))


@pytest.mark.slow
def test_fit_connects_to_a_scheduler_address_and_disconnects_after(client: Client) -> None:
    before = _clients(client)
    address = client.scheduler.address
    x, y = make_data(64)
    result = tiny_pipeline(x, y).fit(1, client=address)
    assert len(result.history.steps) == 4
    assert _clients(client) == before  # the client fit opened is closed again


@pytest.mark.slow
def test_client_or_local_cluster_takes_a_cluster_object(client: Client) -> None:
    cluster = client.cluster
    with client_or_local_cluster(cluster) as connected:
        assert connected is not client and connected.scheduler.address == cluster.scheduler_address
        assert len(connected.scheduler_info()["workers"]) == 2
    assert connected.status == "closed"
    assert client.status == "running"  # the caller's cluster and client stay up
