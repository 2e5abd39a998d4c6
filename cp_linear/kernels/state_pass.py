"""Chunk-to-chunk state recurrence, sequential inside a run of chunks, parallel across runs.

One CTA per (16-column tile of the state, head, run). A run is chunks [g G, (g+1) G) of one
sequence (G = ``group_chunks``; a huge G makes the run the whole sequence). Per chunk, with
w, u, G from ``wy_prepare`` and k_end[i] = exp(G_last - G_i) k_i:

    v_new = u - w h                          [C, W]   (u = 0 without values)
    h    <- exp(G_last) h + k_end^T v_new    [K, W]

Two uses, chosen by run-time switches:
* values (W = V): the state pass of the forward; stores h at every chunk start into
  ``chunk_states`` [C_max, H, K, V] and v_new into ``new_values`` [S_all, H, V], starting from
  zero or from ``initial`` [Z, H, K, V];
* transitions (W = K, no values, identity start): the product of the run's chunk transitions
  M_c = exp(G_last) I - k_end^T w, i.e. the run's dS_out/dS_in, computed without forming M_c.

CTA z works on sequence ``seq_begin + z % seq_count`` and run ``z // seq_count``; the state it
ends with goes to ``final[z - final_begin, h, :, final_col + tile]`` when z >= final_begin.

Inside a chunk every thread owns 4 state columns of one v_new row and of K / 64 state rows, and
reads shared memory 128 bits at a time. The next chunk's w, k and u are loaded into registers
while the current chunk computes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cp_linear.kernels._common import (
    THREADS,
    cutlass_dtype,
    load4,
    smem_matrix,
    smem_vector,
    store4,
    zero_unless,
)
from cp_linear.kernels.configs import CHUNK_SIZE, STATE_TILE, StatePassConfig

C = CHUNK_SIZE
TILE = STATE_TILE
INIT_ZERO, INIT_GIVEN, INIT_IDENTITY = 0, 1, 2


class StatePassKernel:
    def __init__(self, config: StatePassConfig):
        config.validate()
        self.dtype = cutlass_dtype(config.dtype)
        self.key_dim = config.key_dim
        self.loads = C * config.key_dim // THREADS  # elements of w (and of k) per thread per chunk
        self.state_rows = config.key_dim // (THREADS // (TILE // 4))  # state rows per thread

    @cute.jit
    def __call__(self,
                 k: cute.Tensor,  # [S_all, H, K] input dtype
                 w: cute.Tensor,  # [S_all, H, K] float32
                 u: cute.Tensor,  # [S_all, H, W] float32 (read when with_values)
                 gate_cumsum: cute.Tensor,  # [S_all, H] float32
                 k_inv_norm: cute.Tensor,  # [S_all, H] float32
                 cu: cute.Tensor,  # int32 [N + 1]
                 chunk_offsets: cute.Tensor,  # int32 [N + 1]
                 initial: cute.Tensor,  # [Z0, H, K, W] float32 (read when init_kind == 1)
                 chunk_states: cute.Tensor,  # [C_max, H, K, W] float32 (out when store_states)
                 new_values: cute.Tensor,  # [S_all, H, W] float32 (out when store_states)
                 final: cute.Tensor,  # [F, H, K, Wf] float32 (out)
                 width: Int32, num_householder: Int32, seq_begin: Int32, seq_count: Int32,
                 groups_per_seq: Int32, group_chunks: Int32, init_kind: Int32, with_values: Int32,
                 store_states: Int32, final_begin: Int32, final_col: Int32, stream):
        self.kernel(k, w, u, gate_cumsum, k_inv_norm, cu, chunk_offsets, initial, chunk_states, new_values,
                    final, num_householder, seq_begin, seq_count, group_chunks, init_kind, with_values,
                    store_states, final_begin, final_col).launch(
            grid=(width // TILE, k.shape[1], seq_count * groups_per_seq), block=(THREADS, 1, 1),
            stream=stream)

    @cute.jit
    def prefetch(self, k: cute.Tensor, w: cute.Tensor, u: cute.Tensor, gate_cumsum: cute.Tensor,
                 k_inv_norm: cute.Tensor, head: Int32, start: Int32, valid: Int32, col0: Int32,
                 with_values: Int32, w_regs: cute.Tensor, k_regs: cute.Tensor, u_regs: cute.Tensor,
                 scalars: cute.Tensor):
        """Registers <- the chunk at ``start``: w, k (row-major, coalesced), this thread's u, and
        scalars = (G of row tid, 1/|k| of row tid, G_last); zeros past ``valid``. Loads are
        unconditional (clamped rows) so that they are all in flight together."""
        K = self.key_dim
        tidx, _, _ = cute.arch.thread_idx()
        for e in cutlass.range_constexpr(self.loads):
            flat = tidx + THREADS * e
            row = flat // K
            step = start + cutlass.min(row, valid - 1)
            w_regs[e] = zero_unless(row < valid, w[step, head, flat % K])
            k_regs[e] = zero_unless(row < valid, k[step, head, flat % K].to(Float32))
        row = tidx // 4
        for c in cutlass.range_constexpr(4):
            u_regs[c] = Float32(0.0)
        if with_values != 0:
            step = start + cutlass.min(row, valid - 1)
            for c in cutlass.range_constexpr(4):
                u_regs[c] = zero_unless(row < valid, u[step, head, col0 + 4 * (tidx % 4) + c])
        step = start + cutlass.min(tidx, valid - 1)
        scalars[0] = zero_unless(tidx < valid, gate_cumsum[step, head])
        scalars[1] = zero_unless(tidx < valid, k_inv_norm[step, head])
        scalars[2] = gate_cumsum[start + valid - 1, head]

    @cute.kernel
    def kernel(self, k: cute.Tensor, w: cute.Tensor, u: cute.Tensor, gate_cumsum: cute.Tensor,
               k_inv_norm: cute.Tensor, cu: cute.Tensor, chunk_offsets: cute.Tensor, initial: cute.Tensor,
               chunk_states: cute.Tensor, new_values: cute.Tensor, final: cute.Tensor,
               num_householder: Int32, seq_begin: Int32, seq_count: Int32, group_chunks: Int32,
               init_kind: Int32, with_values: Int32, store_states: Int32, final_begin: Int32,
               final_col: Int32):
        K = self.key_dim
        tidx, _, _ = cute.arch.thread_idx()
        tile, head, z = cute.arch.block_idx()
        allocator = cutlass.memory.SmemAllocator()
        s_w = smem_matrix(allocator, C, K)  # w rows
        s_kt = smem_matrix(allocator, K, C)  # keys, transposed: [K, C]
        s_h = smem_matrix(allocator, K, TILE)  # state tile at the chunk start
        s_vs = smem_matrix(allocator, C, TILE)  # v_new rows scaled by exp(G_last - G_i) / |k_i|
        s_factor = smem_vector(allocator, C)

        local_seq = z % seq_count
        seq = seq_begin + local_seq
        run = z // seq_count
        seq_start = cu[seq] * num_householder
        seq_end = cu[seq + 1] * num_householder
        num_chunks = (seq_end - seq_start + C - 1) // C
        first = cutlass.min(run * group_chunks, num_chunks)
        last = cutlass.min(first + group_chunks, num_chunks)
        quad = tidx % 4  # columns 4 quad .. 4 quad + 3 of the tile
        col0 = tile * TILE
        v_row = tidx // 4  # the v_new row of this thread

        # This thread's state entries: rows tidx // 4 + 64 e, columns col0 + 4 quad + c.
        h = cute.make_rmem_tensor(cute.make_layout((self.state_rows * 4,)), Float32)
        for e in cutlass.range_constexpr(self.state_rows):
            row = tidx // 4 + 64 * e
            for c in cutlass.range_constexpr(4):
                col = col0 + 4 * quad + c
                h[4 * e + c] = Float32(0.0)
                if init_kind == INIT_GIVEN:
                    h[4 * e + c] = initial[local_seq, head, row, col]
                if init_kind == INIT_IDENTITY:
                    if row == col:
                        h[4 * e + c] = Float32(1.0)

        w_regs = cute.make_rmem_tensor(cute.make_layout((self.loads,)), Float32)
        k_regs = cute.make_rmem_tensor(cute.make_layout((self.loads,)), Float32)
        u_regs = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
        scalars = cute.make_rmem_tensor(cute.make_layout((3,)), Float32)
        u_now = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
        acc = cute.make_rmem_tensor(cute.make_layout((1, 4)), Float32)
        if first < last:
            chunk_start = seq_start + first * C
            self.prefetch(k, w, u, gate_cumsum, k_inv_norm, head, chunk_start,
                          cutlass.min(seq_end - chunk_start, C), col0, with_values, w_regs, k_regs, u_regs, scalars)

        for m in range(first, last):
            start = seq_start + m * C
            valid = cutlass.min(seq_end - start, C)
            chunk = chunk_offsets[seq] + m
            # registers -> shared memory: the chunk's w rows, transposed keys, row factors, state
            for e in cutlass.range_constexpr(self.loads):
                flat = tidx + THREADS * e
                s_w[flat // K, flat % K] = w_regs[e]
                s_kt[flat % K, flat // K] = k_regs[e]
            if tidx < C:
                factor = Float32(0.0)
                if tidx < valid:
                    factor = cute.math.exp(scalars[2] - scalars[0]) * scalars[1]
                s_factor[tidx] = factor
            gate_last = scalars[2]
            for c in cutlass.range_constexpr(4):
                u_now[c] = u_regs[c]
            for e in cutlass.range_constexpr(self.state_rows):
                row = tidx // 4 + 64 * e
                for c in cutlass.range_constexpr(4):
                    acc[c] = h[4 * e + c]
                    if store_states != 0:
                        chunk_states[chunk, head, row, col0 + 4 * quad + c] = h[4 * e + c]
                store4(s_h, row, quad, acc)
            cute.arch.sync_threads()
            if m + 1 < last:
                next_start = start + C
                self.prefetch(k, w, u, gate_cumsum, k_inv_norm, head, next_start,
                              cutlass.min(seq_end - next_start, C), col0, with_values, w_regs, k_regs, u_regs,
                              scalars)

            # v_new[v_row, 4 quad + c] = u - w h
            for c in cutlass.range_constexpr(4):
                acc[c] = u_now[c]
            for d4 in cutlass.range(K // 4, unroll=4):
                w4 = load4(s_w, v_row, d4)
                for dd in cutlass.range_constexpr(4):
                    h4 = load4(s_h, 4 * d4 + dd, quad)
                    for c in cutlass.range_constexpr(4):
                        acc[c] -= w4[dd] * h4[c]
            if store_states != 0:
                if v_row < valid:
                    for c in cutlass.range_constexpr(4):
                        new_values[start + v_row, head, col0 + 4 * quad + c] = acc[c]
            row_factor = s_factor[v_row]
            for c in cutlass.range_constexpr(4):
                acc[c] = acc[c] * row_factor
            store4(s_vs, v_row, quad, acc)
            cute.arch.sync_threads()

            # h <- exp(G_last) h + sum_i k_i (factor_i v_new_i)
            decay = cute.math.exp(gate_last)
            for e in cutlass.range_constexpr(self.state_rows * 4):
                h[e] = h[e] * decay
            for i4 in cutlass.range(C // 4, unroll=2):
                keys = []
                for e in cutlass.range_constexpr(self.state_rows):
                    keys.append(load4(s_kt, tidx // 4 + 64 * e, i4))
                for ii in cutlass.range_constexpr(4):
                    v4 = load4(s_vs, 4 * i4 + ii, quad)
                    for e in cutlass.range_constexpr(self.state_rows):
                        for c in cutlass.range_constexpr(4):
                            h[4 * e + c] += keys[e][ii] * v4[c]
            cute.arch.sync_threads()

        if z >= final_begin:
            for e in cutlass.range_constexpr(self.state_rows):
                row = tidx // 4 + 64 * e
                for c in cutlass.range_constexpr(4):
                    final[z - final_begin, head, row, final_col + col0 + 4 * quad + c] = h[4 * e + c]
