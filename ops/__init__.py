"""Numba kernels on the data and gradient paths: a CPU kernel (``@njit``) per op and, on
CUDA, a Numba kernel (``numba.cuda.jit``) or, where that lost to torch on the device,
torch code, behind one call that dispatches on the tensor's device
(``dataflow.ops.registry``).

Data path, usable as ``Pipeline(transforms=[...])``: :class:`Log1p`,
:class:`Standardize`, :class:`RandomFlip`, :class:`RandomRotate90`, each with the cast
to the training dtype fused in. Gradient path: :func:`pack_scaled_`,
:func:`sum_of_squares` and :func:`grad_squared_norm` (the one gradient-norm routine).
Spatial decomposition: :func:`pack_halo` / :func:`unpack_halo_`. Optimizers:
:class:`FusedSGD`, :class:`FusedAdam`, one kernel launch per param group, and the
layer-wise :class:`FusedLARS` and :class:`FusedLAMB` for large batches.
"""

from dataflow.ops.flat import grad_squared_norm, pack_scaled_, sum_of_squares
from dataflow.ops.halo import pack_halo, unpack_halo_
from dataflow.ops.layerwise import FusedLAMB, FusedLARS
from dataflow.ops.optim import FusedAdam, FusedSGD
from dataflow.ops.registry import REGISTRY, Op, OpError
from dataflow.ops.transforms import Log1p, RandomFlip, RandomRotate90, Standardize

__all__ = [
    "REGISTRY",
    "FusedAdam",
    "FusedLAMB",
    "FusedLARS",
    "FusedSGD",
    "Log1p",
    "Op",
    "OpError",
    "RandomFlip",
    "RandomRotate90",
    "Standardize",
    "grad_squared_norm",
    "pack_halo",
    "pack_scaled_",
    "sum_of_squares",
    "unpack_halo_",
]
