"""A source over arrays already in memory (numpy arrays or torch tensors)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dataflow.core.batch import Batch
from dataflow.core.errors import DataError
from dataflow.io.region import Bounds, RegionView, compose


def _as_tensor(name: str, array: Any) -> torch.Tensor:
    if isinstance(array, (torch.Tensor, np.ndarray)) and array.ndim == 0:
        # checked first: np.ascontiguousarray would turn a 0-d array into shape (1,)
        raise DataError(
            f"ArraySource: {name} is a scalar (a 0-d array); it needs a leading sample "
            f"dimension: {name}[None] for one sample, numpy.stack(samples) for several"
        )
    if isinstance(array, torch.Tensor):
        tensor = array.detach()
    elif isinstance(array, np.ndarray):
        if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
            raise DataError(
                f"ArraySource: {name} has dtype {array.dtype}, which is not numeric; "
                f"convert it first, e.g. {name}.astype('float32')"
            )
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    else:
        raise DataError(
            f"ArraySource: {name} must be a numpy array or a torch tensor, "
            f"got {type(array).__name__}; wrap it with numpy.asarray({name})"
        )
    return tensor


class ArraySource(RegionView):
    """Samples along the first dimension of ``x`` (and ``y``), held in memory.

    ``shuffle`` draws a new sample order each epoch from (seed, epoch); the fit's
    seed is used, so runs are reproducible.
    """

    def __init__(self, x: Any, y: Any = None, *, shuffle: bool = True) -> None:
        self.x = _as_tensor("x", x)
        self.y = None if y is None else _as_tensor("y", y)
        if self.y is not None and len(self.y) != len(self.x):
            raise DataError(
                f"ArraySource: x has {len(self.x)} samples but y has {len(self.y)}; "
                "both need the same length along their first (sample) dimension"
            )
        if len(self.x) == 0:
            raise DataError("ArraySource: x has no samples (its first dimension is 0)")
        self.shuffle = bool(shuffle)
        self._sample_shape = tuple(int(n) for n in self.x.shape[1:])
        self._region: Bounds | None = None  # see region()

    @property
    def num_samples(self) -> int:
        return len(self.x)

    @property
    def chunk_samples(self) -> int:
        """In memory every sample is its own chunk: the shuffle is a full permutation."""
        return 1

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One sample's x shape, whole (before any region)."""
        return self._sample_shape

    def region(self, bounds: Mapping[int, tuple[int, int]]) -> ArraySource:
        """A view whose x is ``[lo, hi)`` along each given axis of every sample
        (whole-sample coordinates, axis 0 the channels; see ``io.region``); y is whole.
        No copy is made here; pickling it (to a worker) carries only the region."""
        new = compose("ArraySource", bounds, self._sample_shape, self._region)
        old = self.region_bounds
        cut = tuple(slice(lo - was, hi - was) for (lo, hi), (was, _) in zip(new, old, strict=True))
        view = copy.copy(self)
        view.x = self.x[(slice(None), *cut)]
        view._region = new
        return view

    def read(self, indices: np.ndarray) -> Batch:
        """The samples at ``indices`` (in that order) as one batch."""
        index = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        if self.x.device.type != "cpu":  # uploaded once (io.device_copy): gather there
            # through pinned memory without blocking: a pageable copy makes the host wait
            # for every kernel queued before it, so the next step could not be queued
            # while this one runs (torch's pinned cache keeps the block until it is copied)
            index = index.pin_memory().to(self.x.device, non_blocking=True)
        x = self.x.index_select(0, index)
        y = None if self.y is None else self.y.index_select(0, index)
        return Batch(x=x, y=y, size=len(index), indices=indices)

    def __getstate__(self) -> dict[str, Any]:
        """A view (a region, a slice the user passed) pickles only its own elements:
        torch would otherwise write the whole storage it is a view of."""
        state = self.__dict__.copy()
        for key in ("x", "y"):
            tensor = state[key]
            if tensor is not None and tensor.untyped_storage().nbytes() > tensor.nbytes:
                state[key] = tensor.clone(memory_format=torch.contiguous_format)
        return state

    def __repr__(self) -> str:
        y = "None" if self.y is None else f"{tuple(self.y.shape)}"
        region = "" if self._region is None else f", region={self._region}"
        return f"ArraySource(x={tuple(self.x.shape)}, y={y}, shuffle={self.shuffle}{region})"
