"""Per-chunk output on each token's last step (one CTA per chunk, head and 64 value columns).

For output row r of a chunk (step i_r, the last step of token t_r) with the state h at the
chunk start and v_new from the state pass:

    o[t_r] = scale (exp(G_{i_r}) q_r h + sum_{j <= i_r} (q_r . k_j) exp(G_{i_r} - G_j) v_new_j)

Only the steps i with (global step) % n_h == n_h - 1 carry a query, so a chunk has R <=
ceil(64 / n_h) output rows. Each thread owns rows t // 16 + 16 a (a < ceil(R / 16)) and, for
the scores, key columns t % 16 + 16 b, for the output, value columns 4 (t % 16) .. + 3; shared
memory is read 128 bits at a time.
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
from cp_linear.kernels.configs import CHUNK_SIZE, OUTPUT_TILE, OutputConfig

C = CHUNK_SIZE
TILE = OUTPUT_TILE
ROW_BLOCKS = C // 16  # a thread owns up to 4 output rows, 16 apart


class OutputKernel:
    def __init__(self, config: OutputConfig):
        config.validate()
        self.dtype = cutlass_dtype(config.dtype)
        self.key_dim = config.key_dim
        self.value_dim = config.value_dim

    @cute.jit
    def __call__(self,
                 q: cute.Tensor,  # [T_all, H, K] input dtype
                 k: cute.Tensor,  # [S_all, H, K] input dtype
                 k_inv_norm: cute.Tensor,  # [S_all, H] float32
                 new_values: cute.Tensor,  # [S_all, H, V] float32
                 chunk_states: cute.Tensor,  # [C_max, H, K, V] float32
                 gate_cumsum: cute.Tensor,  # [S_all, H] float32
                 cu: cute.Tensor,  # int32 [N + 1] (only its length is read)
                 chunk_offsets: cute.Tensor,  # int32 [N + 1]
                 chunk_start: cute.Tensor,  # int32 [C_max]
                 chunk_len: cute.Tensor,  # int32 [C_max]
                 o: cute.Tensor,  # [T_all, H, V] input dtype (out)
                 scale: Float32, num_householder: Int32, use_l2: Int32, stream):
        num_seqs = cu.shape[0] - 1
        self.kernel(q, k, k_inv_norm, new_values, chunk_states, gate_cumsum, chunk_offsets, chunk_start,
                    chunk_len, o, num_seqs, scale, num_householder, use_l2).launch(
            grid=(chunk_start.shape[0], q.shape[1], self.value_dim // TILE), block=(THREADS, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, k_inv_norm: cute.Tensor, new_values: cute.Tensor,
               chunk_states: cute.Tensor, gate_cumsum: cute.Tensor, chunk_offsets: cute.Tensor,
               chunk_start: cute.Tensor, chunk_len: cute.Tensor, o: cute.Tensor, num_seqs: Int32, scale: Float32,
               num_householder: Int32, use_l2: Int32):
        K = self.key_dim
        tidx, _, _ = cute.arch.thread_idx()
        chunk, head, tile = cute.arch.block_idx()
        allocator = cutlass.memory.SmemAllocator()
        s_q = smem_matrix(allocator, C, K)
        s_k = smem_matrix(allocator, C, K)
        s_h = smem_matrix(allocator, K, TILE)
        s_v = smem_matrix(allocator, C, TILE)
        s_p = smem_matrix(allocator, C, C)
        s_gate = smem_vector(allocator, C)

        if chunk < chunk_offsets[num_seqs]:
            start = chunk_start[chunk]
            valid = chunk_len[chunk]
            # Output rows: steps first_row + r n_h (first_row = the chunk's first last-step).
            first_row = (num_householder - 1 - start % num_householder) % num_householder
            num_rows = (valid - first_row + num_householder - 1) // num_householder
            first_token = (start + first_row) // num_householder
            col0 = tile * TILE
            row_blocks = (num_rows + 15) // 16

            # All loads first (independent and unconditional, from clamped rows), then one barrier.
            for e in cutlass.range_constexpr(K * TILE // THREADS):
                flat = tidx + THREADS * e
                s_h[flat // TILE, flat % TILE] = chunk_states[chunk, head, flat // TILE, col0 + flat % TILE]
            for e in cutlass.range_constexpr(C * TILE // THREADS):
                flat = tidx + THREADS * e
                row = flat // TILE
                value = new_values[start + cutlass.min(row, valid - 1), head, col0 + flat % TILE]
                s_v[row, flat % TILE] = zero_unless(row < valid, value)
            for e in cutlass.range_constexpr(C * K // THREADS):
                flat = tidx + THREADS * e
                row = flat // K
                step = start + cutlass.min(row, valid - 1)
                value = k[step, head, flat % K].to(Float32) * k_inv_norm[step, head]
                s_k[row, flat % K] = zero_unless(row < valid, value)
            if tidx < C:
                gate = gate_cumsum[start + cutlass.min(tidx, valid - 1), head]
                s_gate[tidx] = zero_unless(tidx < valid, gate)
            load_rows_f32(q, first_token, num_rows, head, s_q, use_l2, s_gate, K, False)
            cute.arch.sync_threads()

            row_base = tidx // 16
            lane16 = tidx % 16
            # Scores P[r, j] = (q_r . k_j) exp(G_{i_r} - G_j) for j <= i_r.
            acc = cute.make_rmem_tensor(cute.make_layout((ROW_BLOCKS * 4,)), Float32)
            for e in cutlass.range_constexpr(ROW_BLOCKS * 4):
                acc[e] = Float32(0.0)
            # (vectors read before a dynamic branch are kept in a register tensor: values traced
            # outside a staged ``if`` may not be captured by its body)
            staged = cute.make_rmem_tensor(cute.make_layout((16,)), Float32)
            for d4 in cutlass.range(K // 4, unroll=2):
                for b in cutlass.range_constexpr(4):
                    k4 = load4(s_k, lane16 + 16 * b, d4)
                    for dd in cutlass.range_constexpr(4):
                        staged[4 * b + dd] = k4[dd]
                for a in cutlass.range_constexpr(ROW_BLOCKS):
                    if a < row_blocks:
                        q4 = load4(s_q, row_base + 16 * a, d4)
                        for b in cutlass.range_constexpr(4):
                            for dd in cutlass.range_constexpr(4):
                                acc[4 * a + b] += q4[dd] * staged[4 * b + dd]
            for a in cutlass.range_constexpr(ROW_BLOCKS):
                if a < row_blocks:
                    r = row_base + 16 * a
                    for b in cutlass.range_constexpr(4):
                        j = lane16 + 16 * b
                        value = Float32(0.0)
                        if r < num_rows:
                            i = first_row + r * num_householder
                            if j <= i:
                                value = acc[4 * a + b] * cute.math.exp(s_gate[i] - s_gate[j])
                        s_p[r, j] = value
            cute.arch.sync_threads()

            # o[r, 4 lane16 + c]: inter-chunk part q h, gated, then the intra-chunk part P v_new.
            for e in cutlass.range_constexpr(ROW_BLOCKS * 4):
                acc[e] = Float32(0.0)
            for d4 in cutlass.range(K // 4, unroll=2):
                for dd in cutlass.range_constexpr(4):
                    h4 = load4(s_h, 4 * d4 + dd, lane16)
                    for c in cutlass.range_constexpr(4):
                        staged[4 * dd + c] = h4[c]
                for a in cutlass.range_constexpr(ROW_BLOCKS):
                    if a < row_blocks:
                        q4 = load4(s_q, row_base + 16 * a, d4)
                        for dd in cutlass.range_constexpr(4):
                            for c in cutlass.range_constexpr(4):
                                acc[4 * a + c] += q4[dd] * staged[4 * dd + c]
            top_row = cutlass.min(row_base + 16 * (row_blocks - 1), num_rows - 1)
            for a in cutlass.range_constexpr(ROW_BLOCKS):
                if a < row_blocks:
                    r = row_base + 16 * a
                    gate = Float32(0.0)
                    if r < num_rows:
                        gate = cute.math.exp(s_gate[first_row + r * num_householder])
                    for c in cutlass.range_constexpr(4):
                        acc[4 * a + c] = acc[4 * a + c] * gate
            for j4 in range((first_row + top_row * num_householder) // 4 + 1):
                for jj in cutlass.range_constexpr(4):
                    v4 = load4(s_v, 4 * j4 + jj, lane16)
                    for c in cutlass.range_constexpr(4):
                        staged[4 * jj + c] = v4[c]
                for a in cutlass.range_constexpr(ROW_BLOCKS):
                    if a < row_blocks:
                        p4 = load4(s_p, row_base + 16 * a, j4)
                        for jj in cutlass.range_constexpr(4):
                            for c in cutlass.range_constexpr(4):
                                acc[4 * a + c] += p4[jj] * staged[4 * jj + c]
            for a in cutlass.range_constexpr(ROW_BLOCKS):
                r = row_base + 16 * a
                if r < num_rows:
                    for c in cutlass.range_constexpr(4):
                        o[first_token + r, head, col0 + 4 * lane16 + c] = (scale * acc[4 * a + c]).to(o.element_type)
