"""Column sums of a float32 [R, N] array in a fixed order: the weight gradients of the layer kernels
(``short_conv``, ``gated_rms_norm``) from their per-CTA partial rows, deterministically (no atomics).

Columns are viewed as [N / 4, 4] (16-byte vectors). A CTA takes ``COLUMN_SUM_THREADS / ROW_GROUPS``
neighbouring column vectors (a warp reads 512 contiguous bytes of a row); row group g adds rows
g, g + G, g + 2G, ... in order, then the first group adds the G group sums in order. Every sum's order
depends on R only, not on the schedule.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cp_linear.kernels.configs import COLUMN_SUM_ROW_GROUPS as ROW_GROUPS
from cp_linear.kernels.configs import COLUMN_SUM_THREADS as THREADS
from cp_linear.kernels.configs import COLUMN_SUM_VECTOR as VEC
from cp_linear.kernels.configs import ColumnSumConfig

COLUMNS_PER_CTA = THREADS // ROW_GROUPS  # column vectors


class ColumnSumKernel:
    def __init__(self, config: ColumnSumConfig):
        config.validate()

    @cute.jit
    def __call__(self,
                 rows: cute.Tensor,  # [R, N/4, 4] float32
                 sums: cute.Tensor,  # [N/4, 4] float32
                 stream):
        blocks = (rows.shape[1] + COLUMNS_PER_CTA - 1) // COLUMNS_PER_CTA
        self.kernel(rows, sums).launch(grid=(blocks, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, rows: cute.Tensor, sums: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        group, lane = tidx // COLUMNS_PER_CTA, tidx % COLUMNS_PER_CTA
        column = block * COLUMNS_PER_CTA + lane
        allocator = cutlass.utils.SmemAllocator()
        s_sums = allocator.allocate_tensor(Float32, cute.make_layout((THREADS, VEC), stride=(VEC, 1)), 16)
        total = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
        total.fill(0.0)
        inside = column < rows.shape[1]
        clamped = cutlass.min(column, rows.shape[1] - 1)  # a valid column; its sum is not stored
        for r in cutlass.range(group, rows.shape[0], ROW_GROUPS, unroll=4):
            total.store(total.load() + rows[r, clamped, None].load())
        s_sums[tidx, None].store(total.load())
        cute.arch.sync_threads()
        if (group == 0) & inside:
            total.fill(0.0)
            for g in cutlass.range_constexpr(ROW_GROUPS):
                total.store(total.load() + s_sums[g * COLUMNS_PER_CTA + lane, None].load())
            sums[column, None].store(total.load())
