"""The GDP input value checks in one launch (``cp_linear.validation.GDP_VALUE_CHECKS``).

Grid (blocks, 5): blockIdx.y picks the tensor (0 q, 1 k, 2 v, 3 g, 4 beta, the order of the checks),
and that row's CTAs grid-stride over it in 16-byte vectors (8 bf16 / fp16 or 4 float32 values). A
thread loads ``VALUE_CHECKS_UNROLL`` vectors per step before it tests any, so that several loads are
in flight; an index past the last whole vector is clamped to it, which tests real elements twice and
needs no mask. The elements after the last whole vector (fewer than one vector) are tested one per
thread by the row's first CTA.

Every value is tested in float32: non-finite (x != x or |x| = inf); for g, x > 0; for beta, x < 0 or
x > BETA_MAX. NaN fails no comparison, so it sets only its tensor's non-finite flag (+inf > 0 does set
the g flag). A thread keeps two booleans (non-finite, out of range); each warp votes, and thread 0
combines the warps' votes from shared memory and ORs 1 into flags[tensor] and flags[5] (g) or
flags[6] (beta): at most two atomics per CTA, issued only when set. OR is commutative and idempotent,
so the flags do not depend on the order of the CTAs.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32

from cp_linear.kernels.configs import VALUE_CHECKS_THREADS as THREADS
from cp_linear.kernels.configs import VALUE_CHECKS_UNROLL as UNROLL
from cp_linear.kernels.configs import ValueChecksConfig
from cp_linear.validation import BETA_MAX

WARPS = THREADS // 32
VECTOR_BITS = 128
TENSORS = 5  # q, k, v, g, beta: blockIdx.y
G_POSITIVE_FLAG, BETA_RANGE_FLAG = 5, 6  # flags of the range checks (GDP_VALUE_CHECKS order)
NO_RANGE, POSITIVE, OUTSIDE_BETA = 0, 1, 2  # the range check of a tensor (q, k, v have none)


@cute.jit
def _test(value: Float32, nonfinite: Boolean, outside: Boolean, range_check: cutlass.Constexpr):
    """(nonfinite, outside) updated with one value."""
    nonfinite = nonfinite | (value != value) | (cute.math.abs(value) == Float32(float("inf")))
    if cutlass.const_expr(range_check == POSITIVE):
        outside = outside | (value > Float32(0.0))
    if cutlass.const_expr(range_check == OUTSIDE_BETA):
        outside = outside | (value < Float32(0.0)) | (value > Float32(BETA_MAX))
    return nonfinite, outside


@cute.jit
def _scan(x: cute.Tensor, range_check: cutlass.Constexpr):
    """(nonfinite, outside) over this thread's share of ``x`` (1-D, 16-byte aligned)."""
    per_vector = VECTOR_BITS // x.element_type.width
    tidx, _, _ = cute.arch.thread_idx()
    block, _, _ = cute.arch.block_idx()
    blocks, _, _ = cute.arch.grid_dim()
    size = x.shape[0]
    vectors = size // per_vector
    nonfinite, outside = Boolean(False), Boolean(False)
    for first in range(block * THREADS * UNROLL + tidx, vectors, blocks * THREADS * UNROLL):
        values = cute.make_rmem_tensor(cute.make_layout((per_vector, UNROLL)), Float32)
        for u in cutlass.range_constexpr(UNROLL):
            index = cutlass.min(first + u * THREADS, vectors - 1)
            values[None, u].store(cute.local_tile(x, (per_vector,), (index,)).load().to(Float32))
        for u in cutlass.range_constexpr(UNROLL):
            for j in cutlass.range_constexpr(per_vector):
                nonfinite, outside = _test(values[j, u], nonfinite, outside, range_check)
    tail = vectors * per_vector + tidx
    if (block == 0) & (tail < size):
        nonfinite, outside = _test(x[tail].to(Float32), nonfinite, outside, range_check)
    return nonfinite, outside


@cute.jit
def _set_flag(flags: cute.Tensor, index):
    """flags[index] |= 1 in global memory (a reduction: no value comes back)."""
    cute.arch.red((flags.iterator + index).llvm_ptr, Int32(1), op="or", dtype="b32", sem="relaxed", scope="gpu")


class ValueChecksKernel:
    def __init__(self, config: ValueChecksConfig):
        config.validate()  # the tensors carry their element types: nothing else to derive

    @cute.jit
    def __call__(self,
                 q: cute.Tensor,  # [B·T·H·K] input dtype
                 k: cute.Tensor,  # [B·S·H·K] input dtype
                 v: cute.Tensor,  # [B·S·H·V] input dtype
                 g: cute.Tensor,  # [B·T·H] float32
                 beta: cute.Tensor,  # [B·S·H] float32
                 flags: cute.Tensor,  # int32 [7] (zero-filled by the caller; ORed into)
                 blocks: Int32,  # CTAs per tensor
                 stream):
        self.kernel(q, k, v, g, beta, flags).launch(grid=(blocks, TENSORS, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
               flags: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        _, tensor, _ = cute.arch.block_idx()
        allocator = cutlass.utils.SmemAllocator()
        s_votes = allocator.allocate_tensor(Int32, cute.make_layout((WARPS,)), 16)
        nonfinite, outside = Boolean(False), Boolean(False)
        if tensor == 0:
            nonfinite, outside = _scan(q, NO_RANGE)
        elif tensor == 1:
            nonfinite, outside = _scan(k, NO_RANGE)
        elif tensor == 2:
            nonfinite, outside = _scan(v, NO_RANGE)
        elif tensor == 3:
            nonfinite, outside = _scan(g, POSITIVE)
        else:
            nonfinite, outside = _scan(beta, OUTSIDE_BETA)
        # bit 0: a value of the warp is non-finite; bit 1: one is out of range
        any_nonfinite = cute.arch.vote_any_sync(nonfinite)
        any_outside = cute.arch.vote_any_sync(outside)
        if tidx % 32 == 0:
            s_votes[tidx // 32] = cutlass.select_(any_nonfinite, Int32(1), Int32(0)) | cutlass.select_(
                any_outside, Int32(2), Int32(0))
        cute.arch.sync_threads()
        if tidx == 0:
            votes = Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                votes = votes | s_votes[w]
            if votes & 1:
                _set_flag(flags, tensor)
            if votes & 2:
                _set_flag(flags, cutlass.select_(tensor == 3, Int32(G_POSITIVE_FLAG), Int32(BETA_RANGE_FLAG)))
