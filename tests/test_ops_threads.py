"""A CPU kernel must leave torch's thread budget alone.

Numba's ``omp`` threading layer sets OpenMP's thread count to all the cores when it
starts, and torch shares that runtime: a replica's first Numba kernel used to move
torch from its worker's share of the cores to all of them, oversubscribing the node
and changing torch's reduction order (two runs of one seed then differed in the last
bits). A fresh process, so the layer really starts here.
"""

import subprocess
import sys

CODE = """
import torch
torch.set_num_threads(1)
from dataflow.ops import grad_squared_norm
x = [torch.randn(1 << 18) for _ in range(4)]
grad_squared_norm(x)
assert torch.get_num_threads() == 1, torch.get_num_threads()
"""


def test_the_first_cpu_kernel_keeps_torch_threads():
    subprocess.run([sys.executable, "-c", CODE], check=True)
