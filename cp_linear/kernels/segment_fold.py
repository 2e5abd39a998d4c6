"""Float32 fold of segment summaries along each sequence: every segment's incoming state.

The states are transposed row stacks X [R, K] (R = V for states, R = V + K for a whole
[E^T ; M^T] summary). Segment s of sequence n has the summary rows [E_s^T ; M_s^T] from
``chunk_scan`` (mode "summary"), and maps X -> X M_s^T + E_s^T (the CP summary algebra of
``cp_linear.summary``, transposed). Per sequence n >= ``first_sequence``:

    X = init[n] (n < init_count), else zero rows with identity rows from ``identity_row`` on
    for s in the sequence's segments:   incoming[s] = X;  X = X M_s^T + E_s^T
    final[n] = X                                     (when ``write_final``)

With ``descending`` the segments are taken last to first: the backward's state gradients, whose
segment summaries [gamma^T ; M_b^T] (``chunk_reverse.ChunkGammaKernel``) have the same row form.
The map of the segment taken last is applied only when ``write_final`` asks for the end state
(the output or reverse pass computes it otherwise). One CTA of 256 threads per (sequence, head, 16-row tile); each
thread owns K / 16 strided columns of the tile. M_s^T is staged in shared memory with 16-byte loads
(every thread of the CTA reads all of it), then each thread runs its K-long dot products from
there. Exact float32 arithmetic, no tensor cores: the fold is small next to the scan.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cp_linear.kernels.configs import SegmentFoldConfig

ROWS = 16
THREADS = 256


class SegmentFoldKernel:
    def __init__(self, config: SegmentFoldConfig):
        config.validate()
        self.key_dim = config.key_dim

    @cute.jit
    def __call__(self,
                 summaries: cute.Tensor,  # [S_max, H, V + K, K] float32 (rows [E^T ; M^T])
                 seq_first_segment: cute.Tensor,  # int32 [N + 1]
                 init: cute.Tensor,  # [N_init, H, R, K] float32
                 incoming: cute.Tensor,  # [S_max, H, R, K] float32 (out)
                 final: cute.Tensor,  # [N_final, H, R, K] float32 (out when write_final)
                 init_count: Int32,  # sequences n < init_count start from init[n]
                 value_rows: Int32,  # V: rows of E^T in a summary
                 identity_row: Int32,  # zero init rows >= identity_row start as identity rows
                 first_sequence: Int32, write_final: Int32, descending: Int32, stream):
        rows = incoming.shape[2]
        self.kernel(summaries, seq_first_segment, init, incoming, final, init_count, value_rows, identity_row,
                    first_sequence, write_final, descending).launch(
            grid=(seq_first_segment.shape[0] - 1, summaries.shape[1], (rows + ROWS - 1) // ROWS),
            block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, summaries: cute.Tensor, seq_first_segment: cute.Tensor, init: cute.Tensor,
               incoming: cute.Tensor, final: cute.Tensor, init_count: Int32, value_rows: Int32,
               identity_row: Int32, first_sequence: Int32, write_final: Int32, descending: Int32):
        K = self.key_dim
        per_thread = K * ROWS // THREADS
        tidx, _, _ = cute.arch.thread_idx()
        sequence, head, tile = cute.arch.block_idx()
        allocator = cutlass.utils.SmemAllocator()
        s_x = allocator.allocate_tensor(Float32, cute.make_layout((ROWS, K), stride=(K + 4, 1)), 16)
        s_m = allocator.allocate_tensor(Float32, cute.make_layout((K, K), stride=(K, 1)), 16)
        rows = incoming.shape[2]
        local_row = tidx // (THREADS // ROWS)
        row = tile * ROWS + local_row
        col0 = tidx % (THREADS // ROWS)  # a thread owns columns col0 + 16 j: conflict-free reads of M^T
        row_ok = row < rows
        safe_row = cutlass.min(row, rows - 1)
        if sequence >= first_sequence:
            x = cute.make_rmem_tensor(cute.make_layout((per_thread,)), Float32)
            for j in cutlass.range_constexpr(per_thread):
                value = Float32(0.0)
                if sequence < init_count:
                    value = init[sequence, head, safe_row, col0 + 16 * j]
                elif row >= identity_row:
                    if row - identity_row == col0 + 16 * j:
                        value = Float32(1.0)
                x[j] = value
            first = seq_first_segment[sequence]
            count = seq_first_segment[sequence + 1] - first
            mapped = count if write_final != 0 else count - 1
            for position in range(count):
                segment = first + position
                if descending != 0:
                    segment = first + count - 1 - position
                if row_ok:
                    for j in cutlass.range_constexpr(per_thread):
                        incoming[segment, head, row, col0 + 16 * j] = x[j]
                if position < mapped:
                    # stage M^T (K x K float32) with 16-byte loads, and this tile's X rows
                    for chunk in cutlass.range_constexpr(K * K // 4 // THREADS):
                        flat = (chunk * THREADS + tidx) * 4
                        source = cute.local_tile(summaries[segment, head, None, None], (1, 4),
                                                 (value_rows + flat // K, (flat % K) // 4))
                        cute.local_tile(s_m, (1, 4), (flat // K, (flat % K) // 4)).store(source.load())
                    for j in cutlass.range_constexpr(per_thread):
                        s_x[local_row, col0 + 16 * j] = x[j]
                    cute.arch.sync_threads()
                    # X <- X M^T + E^T: new[r, c] = sum_m X[r, m] M^T[m, c] + E^T[r, c]
                    for j in cutlass.range_constexpr(per_thread):
                        x[j] = Float32(0.0)
                        if row < value_rows:
                            x[j] = summaries[segment, head, row, col0 + 16 * j]
                    for m in cutlass.range(K, unroll=8):
                        left = s_x[local_row, m]
                        for j in cutlass.range_constexpr(per_thread):
                            x[j] += left * s_m[m, col0 + 16 * j]
                    cute.arch.sync_threads()
            if write_final != 0:
                if row_ok:
                    for j in cutlass.range_constexpr(per_thread):
                        final[sequence, head, row, col0 + 16 * j] = x[j]
