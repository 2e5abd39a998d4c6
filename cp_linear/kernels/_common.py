"""Scalar device helpers shared by the GDP kernels (imported only when a kernel is compiled).

Index conventions inside every kernel (docs/design.md §2, flattened over the batch rows):
q [T_all, H, K], k [S_all, H, K], v [S_all, H, V], g [T_all, H], beta [S_all, H] with
S_all = T_all * n_h interleaved steps. The chunk and segment tables come from
``cp_linear.kernels.launch.forward_layout``; tensor-core helpers are in ``_mma``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cp_linear.gdp import L2NORM_EPS

CUTLASS_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}


def cutlass_dtype(name: str):
    return CUTLASS_DTYPES[name]


def smem_vector(allocator, size: int, dtype=Float32):
    return allocator.allocate_tensor(dtype, cute.make_layout((size,)), 16)


def zero_unless(condition, value):
    """``value`` where ``condition`` holds, else 0.0, without a branch.

    Kernels load from a clamped (always valid) index and then select: a load inside an ``if``
    gets its own basic block, and such loads are issued one round trip at a time.
    """
    return Float32(cutlass.select_(condition, value, Float32(0.0)))
