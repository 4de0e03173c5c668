"""A source over arrays already in memory (numpy arrays or torch tensors)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dataflow.core.batch import Batch
from dataflow.core.errors import DataError


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


class ArraySource:
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

    @property
    def num_samples(self) -> int:
        return len(self.x)

    @property
    def chunk_samples(self) -> int:
        """In memory every sample is its own chunk: the shuffle is a full permutation."""
        return 1

    def read(self, indices: np.ndarray) -> Batch:
        """The samples at ``indices`` (in that order) as one batch."""
        index = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        x = self.x.index_select(0, index)
        y = None if self.y is None else self.y.index_select(0, index)
        return Batch(x=x, y=y, size=len(index), indices=indices)

    def __repr__(self) -> str:
        y = "None" if self.y is None else f"{tuple(self.y.shape)}"
        return f"ArraySource(x={tuple(self.x.shape)}, y={y}, shuffle={self.shuffle})"
