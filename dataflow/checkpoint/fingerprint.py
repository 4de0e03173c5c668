"""Fingerprints: what must match for a checkpoint to resume a fit.

:func:`fingerprint` records the model's parameter and buffer names, shapes and dtypes,
the dataset's size, arrays and shuffle flag, and the fit's config (seed, replicas,
schedule); :func:`compare_fingerprints` says what differs between two, one sentence
each. Plain JSON types only, so a checkpoint's manifest holds the fingerprint too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def fingerprint(model: torch.nn.Module, source: Any, config: Mapping[str, Any]) -> dict:
    """What must match to resume: the model's tensors (names, shapes, dtypes, not values),
    the source's sample count, arrays and shuffle flag, and ``config`` (pass at least
    ``seed``, ``replicas`` and ``schedule``; values that are not plain are kept as repr).
    Plain JSON types only, so the manifest can hold it too."""
    parameters = {name for name, _ in model.named_parameters()}
    tensors = {
        name: {
            "kind": "parameter" if name in parameters else "buffer",
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype),
        }
        for name, tensor in model.state_dict().items()
    }
    return {
        "model": tensors,
        "data": _data_fingerprint(source),
        "config": {str(k): _config_value(v) for k, v in config.items()},
    }


def _config_value(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple) and all(
        v is None or isinstance(v, bool | int | float | str) for v in value
    ):
        return list(value)
    return {"repr": repr(value)}  # compared by repr, shown without quotes


def _describe(value: Any) -> str:
    if isinstance(value, dict) and set(value) == {"repr"}:
        return str(value["repr"])
    return repr(value)


def _data_fingerprint(source: Any) -> dict[str, Any]:
    arrays: dict[str, Any] = {}
    readers = source._open() if callable(getattr(source, "_open", None)) else None  # ZarrSource
    if readers:
        for reader in readers:
            arrays[reader.field] = {
                "name": str(reader.name),
                "shape": [int(s) for s in reader.shape],
                "dtype": str(np.dtype(reader.dtype)),
            }
    else:  # ArraySource (tensors x and y) or any source with array attributes
        for name in ("x", "y"):
            array = getattr(source, name, None)
            if hasattr(array, "shape") and hasattr(array, "dtype"):
                dtype = array.dtype
                arrays[name] = {
                    "name": name,
                    "shape": [int(s) for s in array.shape],
                    "dtype": str(dtype).replace("torch.", "")
                    if isinstance(dtype, torch.dtype)
                    else str(np.dtype(dtype)),
                }
    shuffle = getattr(source, "shuffle", None)
    return {
        "num_samples": int(source.num_samples),
        "arrays": arrays,
        "shuffle": shuffle if isinstance(shuffle, bool) else None,
    }


def _shape(value: Any) -> str:
    return str(tuple(value))


def compare_fingerprints(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Every difference between two fingerprints, one sentence each (empty: compatible)."""
    out: list[str] = []
    old_model, new_model = saved.get("model", {}), current.get("model", {})
    for name in old_model.keys() | new_model.keys():
        old, new = old_model.get(name), new_model.get(name)
        kind = (old or new)["kind"]
        if new is None:
            out.append(f"model: {kind} {name} is in the checkpoint but not in the model now")
        elif old is None:
            out.append(f"model: {kind} {name} is in the model now but not in the checkpoint")
        else:
            if old["shape"] != new["shape"]:
                out.append(
                    f"model: {kind} {name} has shape {_shape(old['shape'])} in the checkpoint "
                    f"but {_shape(new['shape'])} now"
                )
            if old["dtype"] != new["dtype"]:
                out.append(
                    f"model: {kind} {name} has dtype {old['dtype']} in the checkpoint but "
                    f"{new['dtype']} now"
                )
    out.sort()  # set order is arbitrary; sorted names read better and test stably

    old_data, new_data = saved.get("data", {}), current.get("data", {})
    if old_data.get("num_samples") != new_data.get("num_samples"):
        out.append(
            f"data: the source has {old_data.get('num_samples')} samples in the checkpoint "
            f"but {new_data.get('num_samples')} now"
        )
    if old_data.get("shuffle") != new_data.get("shuffle"):
        out.append(
            f"data: shuffle is {old_data.get('shuffle')} in the checkpoint but "
            f"{new_data.get('shuffle')} now"
        )
    old_arrays, new_arrays = old_data.get("arrays", {}), new_data.get("arrays", {})
    for key in sorted(old_arrays.keys() | new_arrays.keys()):
        old, new = old_arrays.get(key), new_arrays.get(key)
        if new is None:
            out.append(f"data: array {key} ({old['name']!r}) is in the checkpoint but not now")
        elif old is None:
            out.append(f"data: array {key} ({new['name']!r}) is read now but not in the checkpoint")
        else:
            label = f"array {key} ({new['name']!r})"
            if old["name"] != new["name"]:
                out.append(
                    f"data: array {key} is {old['name']!r} in the checkpoint but {new['name']!r} "
                    "now"
                )
            if old["shape"] != new["shape"]:
                out.append(
                    f"data: {label} has shape {_shape(old['shape'])} in the checkpoint but "
                    f"{_shape(new['shape'])} now"
                )
            if old["dtype"] != new["dtype"]:
                out.append(
                    f"data: {label} has dtype {old['dtype']} in the checkpoint but "
                    f"{new['dtype']} now"
                )

    old_config, new_config = saved.get("config", {}), current.get("config", {})
    for key in sorted(old_config.keys() | new_config.keys()):
        if key not in new_config:
            out.append(
                f"config: {key} is {_describe(old_config[key])} in the checkpoint but not given now"
            )
        elif key not in old_config:
            out.append(
                f"config: {key} is {_describe(new_config[key])} now but not in the checkpoint"
            )
        elif old_config[key] != new_config[key]:
            out.append(
                f"config: {key} is {_describe(old_config[key])} in the checkpoint but "
                f"{_describe(new_config[key])} now"
            )
    return out
