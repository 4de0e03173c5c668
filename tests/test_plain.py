"""to_plain: the one sanitiser for checkpoints (stored form) and history JSON (JSON form)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch

from dataflow.core.errors import DataflowError
from dataflow.core.plain import NotPlainError, to_plain


@dataclasses.dataclass
class Spec:
    size: int = 4


def test_scalars_pass_and_numpy_becomes_python():
    for value in (None, True, 3, 2.5, "x"):
        assert to_plain(value) == value
        assert to_plain(value, json=True) == value
    for form in (False, True):
        out = to_plain({"a": np.int64(3), "b": np.float32(0.5), "c": np.bool_(True)}, json=form)
        assert out == {"a": 3, "b": 0.5, "c": True}
        assert [type(v) for v in out.values()] == [int, float, bool]
        array = to_plain(np.arange(4).reshape(2, 2), json=form)
        assert array == [[0, 1], [2, 3]] and type(array[0][0]) is int


def test_stored_form_keeps_tuples_keys_tensors_and_non_finite_floats():
    tensor = torch.ones(2, requires_grad=True)
    value = OrderedDict(
        [
            (0, {"momentum": tensor}),
            ("rng", ("MT19937", (1, 2), 3)),
            ("dtype", torch.float16),
            ("size", torch.Size([2, 3])),
            ("device", torch.device("cpu")),
            ("raw", b"\x00\x01"),
            ("loss", math.nan),
            ("lists", [1, (2, 3)]),
        ]
    )
    out = to_plain(value)
    assert type(out) is dict and list(out) == list(value)  # int key kept, order kept
    assert out[0]["momentum"] is not tensor and not out[0]["momentum"].requires_grad
    assert out["rng"] == ("MT19937", (1, 2), 3) and type(out["rng"][1]) is tuple
    assert out["dtype"] is torch.float16 and type(out["size"]) is torch.Size
    assert out["device"] == torch.device("cpu") and out["raw"] == b"\x00\x01"
    assert math.isnan(out["loss"]) and out["lists"] == [1, (2, 3)]


def test_json_form_is_strict_json():
    value = {
        1: (1.0, math.nan, math.inf),
        "nested": [{"x": -math.inf}, np.float32("nan")],
        "size": torch.Size([2]),
    }
    out = to_plain(value, json=True)
    assert out == {"1": [1.0, "nan", "inf"], "nested": [{"x": "-inf"}, "nan"], "size": [2]}
    json.dumps(out, allow_nan=False)  # no NaN/Infinity tokens left


def test_input_is_not_changed():
    value = {"a": [1, (2,)], "b": {"c": math.nan}}
    to_plain(value, json=True)
    assert value["a"] == [1, (2,)] and math.isnan(value["b"]["c"])


@pytest.mark.parametrize(
    ("value", "form", "where", "kind"),
    [
        ({"phase": Spec()}, False, "Checkpoint.schedule_state['phase']", "Spec"),
        ([1, {2, 3}], False, "value[1]", "set"),
        ({"t": torch.zeros(1)}, True, "History['t']", "Tensor"),
        ((b"x",), True, "History[0]", "bytes"),
        ({"dtype": torch.float32}, True, "History['dtype']", "dtype"),
    ],
)
def test_what_cannot_be_made_plain_is_refused_naming_where(value, form, where, kind):
    name = where.split("[")[0]
    given = None if name == "value" else name
    with pytest.raises(NotPlainError) as caught:
        to_plain(value, where=given, json=form)
    message = str(caught.value)
    assert message.startswith(f"{where} holds a {kind}"), message
    assert "convert it to" in message
    assert isinstance(caught.value, DataflowError) and isinstance(caught.value, TypeError)
