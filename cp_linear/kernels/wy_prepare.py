"""Per-chunk WY/UT transform (one CTA per chunk and head; chunks are independent).

For a chunk of C <= 64 steps with per-step log gates g_i (g[t] on a token's first step, 0 on
the others), G = cumsum(g) inside the chunk and the (normalised) keys k_i:

    A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)       for j < i, else 0
    w = (I + A)^-1 diag(beta exp(G)) k                 [C, K]
    u = (I + A)^-1 diag(beta) v                        [C, V]

(``cp_linear.reference.wy_chunk`` computes the same in float64.) The triangular solve is a
forward substitution, one thread per column of [k | v], 16 rows at a time in registers.

Writes float32 w [S_all, H, K], u [S_all, H, V], G [S_all, H] and the keys' inverse norms
[S_all, H] (1 without qk l2norm) at the chunk's steps.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cp_linear.kernels._common import (
    THREADS,
    cutlass_dtype,
    load4,
    load_rows_f32,
    smem_matrix,
    smem_vector,
    zero_unless,
)
from cp_linear.kernels.configs import CHUNK_SIZE, WYPrepareConfig

C = CHUNK_SIZE
SOLVE_BLOCK = 16  # rows solved together in registers


class WYPrepareKernel:
    def __init__(self, config: WYPrepareConfig):
        config.validate()
        self.dtype = cutlass_dtype(config.dtype)
        self.key_dim = config.key_dim
        self.value_dim = config.value_dim

    @cute.jit
    def __call__(self,
                 k: cute.Tensor,  # [S_all, H, K] input dtype
                 v: cute.Tensor,  # [S_all, H, V] input dtype
                 g: cute.Tensor,  # [T_all, H] float32
                 beta: cute.Tensor,  # [S_all, H] float32
                 cu: cute.Tensor,  # int32 [N + 1] (only its length is read)
                 chunk_offsets: cute.Tensor,  # int32 [N + 1]
                 chunk_start: cute.Tensor,  # int32 [C_max]
                 chunk_len: cute.Tensor,  # int32 [C_max]
                 w: cute.Tensor,  # [S_all, H, K] float32 (out)
                 u: cute.Tensor,  # [S_all, H, V] float32 (out)
                 gate_cumsum: cute.Tensor,  # [S_all, H] float32 (out)
                 k_inv_norm: cute.Tensor,  # [S_all, H] float32 (out)
                 num_householder: Int32, use_l2: Int32, stream):
        num_seqs = cu.shape[0] - 1
        self.kernel(k, v, g, beta, chunk_offsets, chunk_start, chunk_len, w, u, gate_cumsum, k_inv_norm,
                    num_seqs, num_householder, use_l2).launch(
            grid=(chunk_start.shape[0], k.shape[1], 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
               chunk_offsets: cute.Tensor, chunk_start: cute.Tensor, chunk_len: cute.Tensor,
               w: cute.Tensor, u: cute.Tensor, gate_cumsum: cute.Tensor, k_inv_norm: cute.Tensor,
               num_seqs: Int32, num_householder: Int32, use_l2: Int32):
        K, V = self.key_dim, self.value_dim
        tidx, _, _ = cute.arch.thread_idx()
        chunk, head, _ = cute.arch.block_idx()
        allocator = cutlass.memory.SmemAllocator()
        s_k = smem_matrix(allocator, C, K)
        s_a = smem_matrix(allocator, C, C)
        s_x = allocator.allocate_tensor(Float32, cute.make_layout((C, K + V), stride=(K + V, 1)), 16)
        s_gate = smem_vector(allocator, C)
        s_beta = smem_vector(allocator, C)
        s_inv = smem_vector(allocator, C)

        if chunk < chunk_offsets[num_seqs]:
            start = chunk_start[chunk]
            valid = chunk_len[chunk]

            # Cumulative gate and beta: warp 0, two rows per lane, shuffle scan over the pairs.
            if tidx < 32:
                pair = cute.make_rmem_tensor(cute.make_layout((2,)), Float32)
                for e in cutlass.range_constexpr(2):
                    i = 2 * tidx + e
                    step = start + cutlass.min(i, valid - 1)
                    s_beta[i] = zero_unless(i < valid, beta[step, head])
                    gate = zero_unless(step % num_householder == 0, g[step // num_householder, head])
                    pair[e] = zero_unless(i < valid, gate)
                total = pair[0] + pair[1]
                scan = total
                for d in cutlass.range_constexpr(5):
                    up = cute.arch.shuffle_sync_up(scan, 1 << d)
                    if tidx >= (1 << d):
                        scan = scan + up
                s_gate[2 * tidx] = scan - total + pair[0]
                s_gate[2 * tidx + 1] = scan
            load_rows_f32(k, start, valid, head, s_k, use_l2, s_inv, K, True)
            cute.arch.sync_threads()

            # A: thread t owns rows 4 (t // 16) + r and columns t % 16 + 16 b (4 x 4 entries).
            row_group = tidx // 16
            col_base = tidx % 16
            acc = cute.make_rmem_tensor(cute.make_layout((16,)), Float32)
            for e in cutlass.range_constexpr(16):
                acc[e] = Float32(0.0)
            for d4 in cutlass.range(K // 4, unroll=2):
                rows_k = []
                for r in cutlass.range_constexpr(4):
                    rows_k.append(load4(s_k, 4 * row_group + r, d4))
                for b in cutlass.range_constexpr(4):
                    kb = load4(s_k, col_base + 16 * b, d4)
                    for r in cutlass.range_constexpr(4):
                        for dd in cutlass.range_constexpr(4):
                            acc[4 * r + b] += rows_k[r][dd] * kb[dd]
            for r in cutlass.range_constexpr(4):
                row = 4 * row_group + r
                for b in cutlass.range_constexpr(4):
                    col = col_base + 16 * b
                    value = Float32(0.0)
                    if col < row:
                        value = s_beta[row] * cute.math.exp(s_gate[row] - s_gate[col]) * acc[4 * r + b]
                    s_a[row, col] = value
            cute.arch.sync_threads()

            # Forward substitution X = (I + A)^-1 B for one column of B = [beta e^G k | beta v],
            # in blocks of 16 rows: earlier blocks come from shared memory, the block itself is
            # solved in registers.
            if tidx < K + V:
                x = cute.make_rmem_tensor(cute.make_layout((SOLVE_BLOCK,)), Float32)
                earlier = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
                for block in range(C // SOLVE_BLOCK):
                    base = block * SOLVE_BLOCK
                    for r in cutlass.range_constexpr(SOLVE_BLOCK):
                        i = base + r
                        # beta is 0 on rows past ``valid``; their (clamped) values are finite
                        if tidx < K:
                            x[r] = s_beta[i] * cute.math.exp(s_gate[i]) * s_k[i, tidx]
                        else:
                            x[r] = s_beta[i] * v[start + cutlass.min(i, valid - 1), head, tidx - K].to(Float32)
                    for j4 in range(block * (SOLVE_BLOCK // 4)):
                        for q in cutlass.range_constexpr(4):
                            earlier[q] = s_x[4 * j4 + q, tidx]
                        for r in cutlass.range_constexpr(SOLVE_BLOCK):
                            a = load4(s_a, base + r, j4)
                            for q in cutlass.range_constexpr(4):
                                x[r] -= a[q] * earlier[q]
                    for r in cutlass.range_constexpr(1, SOLVE_BLOCK):
                        total = x[r]
                        for jj in cutlass.range_constexpr(r):
                            total -= s_a[base + r, base + jj] * x[jj]
                        x[r] = total
                    for r in cutlass.range_constexpr(SOLVE_BLOCK):
                        i = base + r
                        s_x[i, tidx] = x[r]
                        if i < valid:
                            if tidx < K:
                                w[start + i, head, tidx] = x[r]
                            else:
                                u[start + i, head, tidx - K] = x[r]
            if tidx < C:
                if tidx < valid:
                    gate_cumsum[start + tidx, head] = s_gate[tidx]
                    k_inv_norm[start + tidx, head] = s_inv[tidx]
