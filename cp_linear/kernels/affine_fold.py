"""Ascending fold of affine maps, S <- M_j S + E_j over j = 0..n-1, for independent (row, head)s.

``stacked`` [n, Z, K, Wt] float32 holds M_j at columns [m_col, m_col + K) and, when
``has_update``, E_j at columns [0, W). Two uses:
* incoming state of a CP rank: stacked = preceding packed summaries [E | M] (Z = B H, W = V,
  m_col = V), S from zero (``cp_linear.summary.compose_forward``);
* a shard's transition M: stacked = run transitions from ``state_pass`` (W = K, m_col = 0,
  no update), S from the identity.
Writes S into ``out[z, :, out_col + c]``. One CTA per (16-column tile, z).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cp_linear.kernels._common import THREADS, smem_matrix
from cp_linear.kernels.configs import STATE_TILE, AffineFoldConfig

TILE = STATE_TILE
ROW_GROUPS = THREADS // TILE


class AffineFoldKernel:
    def __init__(self, config: AffineFoldConfig):
        config.validate()
        self.key_dim = config.key_dim

    @cute.jit
    def __call__(self,
                 stacked: cute.Tensor,  # [n, Z, K, Wt] float32
                 out: cute.Tensor,  # [Z, K, Wo] float32 (out)
                 width: Int32, m_col: Int32, has_update: Int32, init_identity: Int32, out_col: Int32,
                 stream):
        self.kernel(stacked, out, m_col, has_update, init_identity, out_col).launch(
            grid=(width // TILE, stacked.shape[1], 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, stacked: cute.Tensor, out: cute.Tensor, m_col: Int32, has_update: Int32,
               init_identity: Int32, out_col: Int32):
        K = self.key_dim
        rows_per_thread = K // ROW_GROUPS
        tidx, _, _ = cute.arch.thread_idx()
        tile, z, _ = cute.arch.block_idx()
        allocator = cutlass.memory.SmemAllocator()
        s_m = smem_matrix(allocator, K, K)
        s_s = smem_matrix(allocator, K, TILE)
        col = tidx % TILE
        group = tidx // TILE
        col_global = tile * TILE + col

        state = cute.make_rmem_tensor(cute.make_layout((rows_per_thread,)), Float32)
        for r in cutlass.range_constexpr(rows_per_thread):
            state[r] = Float32(0.0)
            if init_identity != 0:
                if group + ROW_GROUPS * r == col_global:
                    state[r] = Float32(1.0)

        for j in range(stacked.shape[0]):
            for r in cutlass.range_constexpr(rows_per_thread):
                s_s[group + ROW_GROUPS * r, col] = state[r]
            for e in cutlass.range(K * K // THREADS, unroll=8):
                flat = tidx + THREADS * e
                s_m[flat // K, flat % K] = stacked[j, z, flat // K, m_col + flat % K]
            cute.arch.sync_threads()
            for r in cutlass.range_constexpr(rows_per_thread):
                row = group + ROW_GROUPS * r
                acc = Float32(0.0)
                if has_update != 0:
                    acc = stacked[j, z, row, col_global]
                for e in cutlass.range(K, unroll=8):
                    acc += s_m[row, e] * s_s[e, col]
                state[r] = acc
            cute.arch.sync_threads()

        for r in cutlass.range_constexpr(rows_per_thread):
            out[z, group + ROW_GROUPS * r, out_col + col_global] = state[r]
