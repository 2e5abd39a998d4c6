"""Device helpers shared by the GDP kernels (imported only when a kernel is compiled).

Index conventions inside every kernel (docs/design.md §2, flattened over the batch rows):
q [T_all, H, K], k [S_all, H, K], v [S_all, H, V], g [T_all, H], beta [S_all, H] with
S_all = T_all * n_h interleaved steps; ``cu`` int32 [N + 1] token offsets of the N sequences.
Sequence n covers steps [cu[n] n_h, cu[n+1] n_h); its chunk m covers the 64 steps from
cu[n] n_h + 64 m (the last one may be shorter), and has the global chunk id
``chunk_offsets[n] + m``.

Shared-memory tiles are float32 with a row pitch of (columns + 4): rows stay 16-byte aligned for
128-bit accesses (``load4`` / ``store4``), and since pitch / 4 is odd, 8 consecutive rows read
at one column fall in 8 different groups of 4 banks (no conflict for a warp reading 8 rows).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cp_linear.gdp import L2NORM_EPS
from cp_linear.kernels.configs import CHUNK_SIZE

THREADS = 256
WARPS = THREADS // 32

CUTLASS_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}


def cutlass_dtype(name: str):
    return CUTLASS_DTYPES[name]


def pitch(cols: int) -> int:
    return cols + 4


def smem_matrix(allocator, rows: int, cols: int):
    """A float32 [rows, cols] shared-memory tile, row pitch cols + 4 (see the module doc)."""
    layout = cute.make_layout((rows, cols), stride=(pitch(cols), 1))
    return allocator.allocate_tensor(Float32, layout, 16)


def smem_vector(allocator, size: int, dtype=Float32):
    return allocator.allocate_tensor(dtype, cute.make_layout((size,)), 16)


@cute.jit
def load4(tile: cute.Tensor, row: Int32, col4: Int32):
    """tile[row, 4 col4 : 4 col4 + 4] as one 128-bit shared-memory load (a TensorSSA of 4)."""
    return cute.local_tile(tile, (1, 4), (row, col4)).load()


@cute.jit
def store4(tile: cute.Tensor, row: Int32, col4: Int32, values: cute.Tensor):
    """tile[row, 4 col4 : 4 col4 + 4] = values (a register tensor of 4) as one 128-bit store."""
    cute.local_tile(tile, (1, 4), (row, col4)).store(values.load())


def zero_unless(condition, value):
    """``value`` where ``condition`` holds, else 0.0, without a branch.

    Kernels load from a clamped (always valid) index and then select: a load inside an ``if``
    gets its own basic block, and such loads are issued one round trip at a time.
    """
    return Float32(cutlass.select_(condition, value, Float32(0.0)))


@cute.jit
def load_rows_f32(src: cute.Tensor, first_row: Int32, count: Int32, head: Int32, dst: cute.Tensor,
                  use_l2: Int32, inv_norm: cute.Tensor, dim: cutlass.Constexpr, store_norm: cutlass.Constexpr):
    """dst[i, :] = f_i * src[first_row + i, head, :] in float32 for i < 64 (zero rows past ``count``).

    f_i = 1 / sqrt(|row|^2 + 1e-6) when ``use_l2``, else 1; also written to ``inv_norm[i]`` when
    ``store_norm``. One warp per row; every row's loads are issued (unconditionally, from clamped
    rows) before the first reduction so their latencies overlap.
    """
    warp = cute.arch.warp_idx()
    lane = cute.arch.lane_idx()
    rows = CHUNK_SIZE // WARPS
    per_lane = dim // 32
    last_row = src.shape[0] - 1
    x = cute.make_rmem_tensor(cute.make_layout((rows * per_lane,)), Float32)
    for j in cutlass.range_constexpr(rows):
        i = warp + WARPS * j
        row = cutlass.min(first_row + cutlass.min(i, cutlass.max(count - 1, 0)), last_row)
        for e in cutlass.range_constexpr(per_lane):
            x[j * per_lane + e] = zero_unless(i < count, src[row, head, lane + 32 * e].to(Float32))
    for j in cutlass.range_constexpr(rows):
        i = warp + WARPS * j
        factor = Float32(1.0)
        if use_l2 != 0:
            sumsq = Float32(0.0)
            for e in cutlass.range_constexpr(per_lane):
                sumsq += x[j * per_lane + e] * x[j * per_lane + e]
            sumsq = cute.arch.warp_reduction_sum(sumsq)
            factor = cute.math.rsqrt(sumsq + Float32(L2NORM_EPS))
        if cutlass.const_expr(store_norm):
            if lane == 0:
                inv_norm[i] = factor
        for e in cutlass.range_constexpr(per_lane):
            dst[i, lane + 32 * e] = x[j * per_lane + e] * factor
