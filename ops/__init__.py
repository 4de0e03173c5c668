"""Numba kernels on the data and gradient paths (CPU ``@njit`` and CUDA), one
function per op dispatching on the tensor's device. Filled in by the ops issue;
any callable on tensors already works as a ``stages.Transform``.
"""

__all__: list[str] = []
