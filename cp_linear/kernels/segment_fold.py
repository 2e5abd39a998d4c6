"""Float32 fold of segment summaries along each sequence, and its one-step companion.

The states are transposed row stacks X [R, K] (R = V for states, R = V + K for a whole
[E^T ; M^T] summary). Segment s of sequence n has the summary rows [E_s^T ; M_s^T] from
``chunk_scan`` (mode "summary"), and maps X -> X M_s^T + E_s^T (the CP summary algebra of
``cp_linear.summary``, transposed).

Mode "fold" (sequential along each sequence). Per sequence n:

    X = init[n] (n < init_count), else zero rows with identity rows from ``identity_row`` on
    X = X + addend[a]^T                              (``add_mode``, below)
    for s in the sequence's segments:   incoming[s] = X;  X = X M_s^T + E_s^T
    final[n] = X                                     (when n writes its final rows)

``write_final``: 0 (``FINAL_NONE``) no sequence writes ``final``; 1 (``FINAL_EVERY``) every
sequence; 2 (``FINAL_TRAILING``) only the trailing ones: the last sequence with segments and the
empty ones after it (a shard's CP summary; the other sequences' last segments have no summary and
their final rows are not needed); 3 (``FINAL_LEADING``) only sequence 0 (the backward summary of a
packed shard: the other sequences then skip their last map, and a one-segment one folds nothing).
With ``descending`` the segments are taken last to first: the
backward's state gradients, whose segment summaries [gamma^T ; M_b^T]
(``chunk_reverse.ChunkGammaKernel``) have the same row form. The map of the segment taken last is
applied only for a sequence that writes its final rows (the output or reverse pass computes the
end state otherwise).

Rows are independent, so a sequence whose transition rows (from ``value_rows`` on) are not needed skips
them: they are folded only for sequences n < ``transition_count`` and for those that write their
final rows (the forward's prefix maps: only the leading sequence may receive a state from the
preceding rank, or each sequence its initial state; the trailing one's final rows are its summary).
The CTAs of the skipped row tiles write nothing.

``add_mode`` (the CP backward's outgoing gradient, ``addend`` [A, H, K, R] in the summaries' column
orientation, added to the start rows as torch's ``end + outgoing``): 0 (``ADD_NONE``) not read; 1
(``ADD_EVERY``) sequence n adds addend[n] (rows shards: every row continues on the next rank); 2
(``ADD_TRAILING``) only the trailing sequence with segments runs, adding addend[0], and the others write
nothing: a packed shard's refold after the following ranks' summaries arrive touches only the
sequence that continues there, in place over the fold that ran without them.

One CTA of ``rows`` * K / 16 threads per (sequence, head, ``rows``-row tile; ``SegmentFoldConfig.rows``
32 or 16: the rows are independent, so smaller tiles put a sequence's chain on more SMs). A warp
owns a 16 x 32 tile, a lane 4 rows x 4 adjacent columns; X is kept transposed in shared memory,
so per m a lane's 4 X values and 4 M^T values are one 16-byte load each, and a warp's two loads are
one wavefront each (64 and 128 bytes) for 16 FMAs (the earlier row-per-warp layout took 8
wavefronts: the step was bound by shared memory). Two groups of warps each sum half of m for the
same tile; the second's partial sums reach the first through shared memory (ncu: with one warp per
scheduler the step was latency-bound; H200, 8 segments x 16 heads, V rows: 36 -> 30 us). The fold is
a chain, so the next segment's M^T (K x K float32) is copied in with cp.async into a second buffer
while the current step computes (its address depends only on the segment table, never on X). Exact float32, a fixed summation
order ((E + sum over m < K/2) + sum over m >= K/2, each in order of m).

Mode "apply_affine" (parallel over segments, one launch). Run with R = V + K, the fold from
[0 ; I] leaves each segment's prefix map in ``summaries`` ([E_pre^T ; M_pre^T] = the incoming
affine map: state in = S0 composed with it). Given the start rows X0 = init[n] of the sequences
n < init_count, it writes every segment's incoming state without a second chain:

    incoming[s] = E_pre_s^T + X0[n(s)] M_pre_s^T    (n(s) < init_count)
    incoming[s] = E_pre_s^T                         (the other sequences: they start from zero)
    incoming[s] = 0                                 (s >= the real segment count: deterministic)

It reads ``summaries``, ``seq_first_segment``, ``init``, ``init_count``, ``value_rows``; ``final``
and the other scalars are not used. One CTA of 256 threads per (segment, head, 64-row tile);
each thread owns 4 rows x K / 16 columns; M_pre^T and the X0 rows are staged in shared memory, the
products summed over m = 0..K-1 in order after E (the fold step's order).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from cp_linear.kernels._common import zero_unless
from cp_linear.kernels.configs import SegmentFoldConfig
from cp_linear.kernels.launch import ADD_EVERY, ADD_NONE, ADD_TRAILING, FINAL_EVERY, FINAL_LEADING, FINAL_TRAILING

WARP_ROWS, WARP_COLS = 16, 32  # fold: a warp's tile of the state rows (each lane 4 x 4)
M_GROUPS = 2  # fold: warp groups that each sum half of m = 0..K-1 for the same tile
THREADS = 256  # apply_affine
AFFINE_ROWS = 16  # apply_affine: rows per 16-thread group; each thread owns AFFINE_GROUPS of them
AFFINE_GROUPS = 4  # (64 rows per CTA share one staged M^T)


class SegmentFoldKernel:
    def __init__(self, config: SegmentFoldConfig):
        config.validate()
        self.key_dim = config.key_dim
        self.apply_affine = config.mode == "apply_affine"
        self.rows = config.rows  # fold: state rows per CTA
        # two groups of warps split the sum over m (ncu: one warp per scheduler left the step latency-bound)
        self.fold_threads = M_GROUPS * config.rows * config.key_dim // (WARP_ROWS * WARP_COLS) * 32

    @cute.jit
    def __call__(self,
                 summaries: cute.Tensor,  # [S_max, H, V + K, K] float32 (rows [E^T ; M^T])
                 seq_first_segment: cute.Tensor,  # int32 [N + 1]
                 init: cute.Tensor,  # [N_init, H, R, K] float32
                 addend: cute.Tensor,  # [A, H, K, R] float32 (read when add_mode != ADD_NONE)
                 incoming: cute.Tensor,  # [S_max, H, R, K] float32 (out)
                 final: cute.Tensor,  # [N_final, H, R, K] float32 (out when write_final)
                 init_count: Int32,  # sequences n < init_count start from init[n]
                 value_rows: Int32,  # V: rows of E^T in a summary
                 identity_row: Int32,  # zero init rows >= identity_row start as identity rows
                 transition_count: Int32,  # rows >= value_rows: folded only for n < transition_count (or final)
                 add_mode: Int32, write_final: Int32, descending: Int32, stream):
        rows = incoming.shape[2]
        if cutlass.const_expr(self.apply_affine):
            tile_rows = AFFINE_ROWS * AFFINE_GROUPS
            self.affine_kernel(summaries, seq_first_segment, init, incoming, init_count, value_rows).launch(
                grid=(incoming.shape[0], summaries.shape[1], (rows + tile_rows - 1) // tile_rows),
                block=(THREADS, 1, 1), stream=stream)
        else:
            self.kernel(summaries, seq_first_segment, init, addend, incoming, final, init_count, value_rows,
                        identity_row, transition_count, add_mode, write_final, descending).launch(
                grid=(seq_first_segment.shape[0] - 1, summaries.shape[1], (rows + self.rows - 1) // self.rows),
                block=(self.fold_threads, 1, 1), stream=stream)

    @cute.jit
    def _stage_transition(self, atom, tidx, summaries: cute.Tensor, segment, head, value_rows, s_m: cute.Tensor,
                          threads: cutlass.Constexpr):
        """cp.async M^T (rows value_rows.. of ``segment``'s summary, K x K) into ``s_m``, 16 bytes per copy."""
        K = self.key_dim
        for chunk in cutlass.range_constexpr(K * K // 4 // threads):
            flat = (chunk * threads + tidx) * 4
            source = cute.local_tile(summaries[segment, head, value_rows + flat // K, None], (4,), ((flat % K) // 4,))
            cute.copy(atom, source, cute.local_tile(s_m[flat // K, None], (4,), ((flat % K) // 4,)))

    @cute.kernel
    def kernel(self, summaries: cute.Tensor, seq_first_segment: cute.Tensor, init: cute.Tensor,
               addend: cute.Tensor, incoming: cute.Tensor, final: cute.Tensor, init_count: Int32,
               value_rows: Int32, identity_row: Int32, transition_count: Int32, add_mode: Int32, write_final: Int32,
               descending: Int32):
        K = self.key_dim
        tile_rows = self.rows
        threads = self.fold_threads
        col_warps = K // WARP_COLS
        tidx, _, _ = cute.arch.thread_idx()
        sequence, head, tile = cute.arch.block_idx()
        allocator = cutlass.utils.SmemAllocator()
        # X^T (m-major): a thread's 4 rows at one m are one 16-byte load, shared by the 8 lanes of its row group
        s_xt = allocator.allocate_tensor(Float32, cute.make_layout((K, tile_rows), stride=(tile_rows + 4, 1)), 16)
        # two M^T buffers: the next step's copy lands in one while the current step reads the other
        s_m2 = allocator.allocate_tensor(Float32, cute.make_layout((K, K, 2), stride=(K, 1, K * K)), 16)
        # the second m group's partial sums, added by the first group
        s_part = allocator.allocate_tensor(Float32, cute.make_layout((tile_rows, K), stride=(K + 4, 1)), 16)
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float32,
                                   num_bits_per_copy=128)
        rows = incoming.shape[2]
        group_threads = threads // M_GROUPS
        m_group = tidx // group_threads  # 0: owns X (E, the stores); 1: sums m = K/2..K-1 only
        half_k = K // M_GROUPS
        warp, lane = (tidx % group_threads) // 32, tidx % 32
        # warp tile WARP_ROWS x WARP_COLS, lanes 4 row groups x 8 column groups, each 4 rows x 4 adjacent
        # columns: per m one 16-byte X^T load (64 bytes per warp) and one 16-byte M^T load (128 bytes per
        # warp), one shared-memory wavefront each, for 16 FMAs
        first_row = (warp // col_warps) * WARP_ROWS + (lane // 8) * 4
        col_group = (warp % col_warps) * (WARP_COLS // 4) + lane % 8
        first_col = col_group * 4
        first = seq_first_segment[sequence]
        count = seq_first_segment[sequence + 1] - first
        sequences = seq_first_segment.shape[0] - 1
        trailing = seq_first_segment[sequence + 1] == seq_first_segment[sequences]
        writes_final = ((write_final == FINAL_EVERY) | ((write_final == FINAL_TRAILING) & trailing)
                        | ((write_final == FINAL_LEADING) & (sequence == 0)))
        # (tiles never straddle value_rows: V is a multiple of 64, tiles 16 or 32 rows)
        needed = (tile * tile_rows < value_rows) | (sequence < transition_count) | writes_final
        if needed & ((add_mode != ADD_TRAILING) | (trailing & (count > 0))):
            x = cute.make_rmem_tensor(cute.make_layout((4, 4), stride=(4, 1)), Float32)
            for i in cutlass.range_constexpr(4):
                row = tile * tile_rows + first_row + i
                # clamped indices (placeholders may be small); the value is used only below init_count
                start = cute.local_tile(init[cutlass.min(sequence, init.shape[0] - 1), head,
                                             cutlass.min(row, init.shape[2] - 1), None], (4,), (col_group,)).load()
                for j in cutlass.range_constexpr(4):
                    identity = cutlass.select_((row >= identity_row) & (row - identity_row == first_col + j),
                                               Float32(1.0), Float32(0.0))
                    x[i, j] = cutlass.select_(sequence < init_count, start[j], identity)
            if add_mode != ADD_NONE:
                # addend is column-oriented (the summaries' [K, R]): 4 scalar loads per row, once per chain
                addend_index = cutlass.min(cutlass.select_(add_mode == ADD_EVERY, sequence, 0), addend.shape[0] - 1)
                for i in cutlass.range_constexpr(4):
                    row = cutlass.min(tile * tile_rows + first_row + i, addend.shape[3] - 1)
                    for j in cutlass.range_constexpr(4):
                        x[i, j] = x[i, j] + addend[addend_index, head, first_col + j, row]
            mapped = count if writes_final else count - 1
            if mapped > 0:
                step_segment = cutlass.select_(descending != 0, first + count - 1, first)
                self._stage_transition(atom, tidx, summaries, step_segment, head, value_rows, s_m2[None, None, 0],
                                       threads)
            cute.arch.cp_async_commit_group()
            for position in range(count):
                segment = first + position
                next_segment = first + position + 1
                if descending != 0:
                    segment = first + count - 1 - position
                    next_segment = first + count - 2 - position
                if m_group == 0:
                    for i in cutlass.range_constexpr(4):
                        row = tile * tile_rows + first_row + i
                        if row < rows:
                            cute.local_tile(incoming[segment, head, row, None], (4,), (col_group,)).store(
                                x[i, None].load())
                if position < mapped:
                    if position + 1 < mapped:
                        self._stage_transition(atom, tidx, summaries, next_segment, head, value_rows,
                                               s_m2[None, None, (position + 1) % 2], threads)
                    cute.arch.cp_async_commit_group()  # possibly empty: one group per step keeps wait(1) right
                    if m_group == 0:
                        for j in cutlass.range_constexpr(4):
                            column = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
                            for i in cutlass.range_constexpr(4):
                                column[i] = x[i, j]
                            cute.local_tile(s_xt[first_col + j, None], (4,), (first_row // 4,)).store(column.load())
                    # X <- X M^T + E^T: new[r, c] = E^T[r, c] + sum_m X[r, m] M^T[m, c], m in order (E's loads
                    # in flight across the barrier)
                    for i in cutlass.range_constexpr(4):
                        row = tile * tile_rows + first_row + i
                        e_row = cutlass.min(row, value_rows - 1)  # E^T rows exist below value_rows only
                        e = cute.local_tile(summaries[segment, head, e_row, None], (4,), (col_group,)).load()
                        for j in cutlass.range_constexpr(4):
                            x[i, j] = zero_unless((row < value_rows) & (m_group == 0), e[j])
                    cute.arch.cp_async_wait_group(1)  # this step's M^T has landed (the next one may not)
                    cute.arch.sync_threads()
                    s_m = s_m2[None, None, position % 2]
                    for m_local in cutlass.range(half_k, unroll=4):
                        m = m_group * half_k + m_local
                        left = cute.local_tile(s_xt[m, None], (4,), (first_row // 4,)).load()
                        right = cute.local_tile(s_m[m, None], (4,), (col_group,)).load()
                        for i in cutlass.range_constexpr(4):
                            for j in cutlass.range_constexpr(4):
                                x[i, j] += left[i] * right[j]
                    if m_group == 1:
                        for i in cutlass.range_constexpr(4):
                            cute.local_tile(s_part[first_row + i, None], (4,), (col_group,)).store(x[i, None].load())
                    cute.arch.sync_threads()
                    if m_group == 0:  # (E + sum over the first half) + sum over the second: a fixed order
                        for i in cutlass.range_constexpr(4):
                            part = cute.local_tile(s_part[first_row + i, None], (4,), (col_group,)).load()
                            for j in cutlass.range_constexpr(4):
                                x[i, j] += part[j]
                    cute.arch.sync_threads()  # s_xt, s_part and this buffer are rewritten by the next steps
            cute.arch.cp_async_wait_group(0)
            if writes_final & (m_group == 0):
                for i in cutlass.range_constexpr(4):
                    row = tile * tile_rows + first_row + i
                    if row < rows:
                        cute.local_tile(final[sequence, head, row, None], (4,), (col_group,)).store(x[i, None].load())

    @cute.kernel
    def affine_kernel(self, affine: cute.Tensor, seq_first_segment: cute.Tensor, init: cute.Tensor,
                      incoming: cute.Tensor, init_count: Int32, value_rows: Int32):
        K = self.key_dim
        per_thread = K * AFFINE_ROWS // THREADS
        tile_rows = AFFINE_ROWS * AFFINE_GROUPS
        tidx, _, _ = cute.arch.thread_idx()
        segment, head, tile = cute.arch.block_idx()
        allocator = cutlass.utils.SmemAllocator()
        s_x = allocator.allocate_tensor(Float32, cute.make_layout((tile_rows, K), stride=(K + 4, 1)), 16)
        s_m = allocator.allocate_tensor(Float32, cute.make_layout((K, K), stride=(K, 1)), 16)
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float32,
                                   num_bits_per_copy=128)
        rows = incoming.shape[2]
        sequences = seq_first_segment.shape[0] - 1
        local_row = tidx // (THREADS // AFFINE_ROWS)
        col0 = tidx % (THREADS // AFFINE_ROWS)
        real = segment < seq_first_segment[sequences]
        # sequences are stored in order, so the segments of sequences below init_count come first
        seeded = segment < seq_first_segment[cutlass.min(init_count, sequences)]
        acc = cute.make_rmem_tensor(cute.make_layout((AFFINE_GROUPS, per_thread)), Float32)
        for g in cutlass.range_constexpr(AFFINE_GROUPS):
            row = tile * tile_rows + local_row + AFFINE_ROWS * g
            e_row = cutlass.min(row, value_rows - 1)
            for j in cutlass.range_constexpr(per_thread):
                acc[g, j] = zero_unless(real & (row < value_rows), affine[segment, head, e_row, col0 + 16 * j])
        if seeded:  # uniform over the CTA: the barriers below are safe
            owner = Int32(0)  # the sequence of this segment: how many sequences end at or before it
            for n in range(init_count):
                owner = owner + cutlass.select_(seq_first_segment[n + 1] <= segment, Int32(1), Int32(0))
            self._stage_transition(atom, tidx, affine, segment, head, value_rows, s_m, THREADS)
            cute.arch.cp_async_commit_group()
            for chunk in cutlass.range_constexpr(tile_rows * K // 4 // THREADS):
                flat = (chunk * THREADS + tidx) * 4
                x_row = cutlass.min(tile * tile_rows + flat // K, rows - 1)
                source = cute.local_tile(init[owner, head, x_row, None], (4,), ((flat % K) // 4,))
                cute.copy(atom, source, cute.local_tile(s_x[flat // K, None], (4,), ((flat % K) // 4,)))
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            for m in cutlass.range(K, unroll=4):
                right = cute.make_rmem_tensor(cute.make_layout((per_thread,)), Float32)
                for j in cutlass.range_constexpr(per_thread):
                    right[j] = s_m[m, col0 + 16 * j]
                for g in cutlass.range_constexpr(AFFINE_GROUPS):
                    left = s_x[local_row + AFFINE_ROWS * g, m]
                    for j in cutlass.range_constexpr(per_thread):
                        acc[g, j] += left * right[j]
        for g in cutlass.range_constexpr(AFFINE_GROUPS):
            row = tile * tile_rows + local_row + AFFINE_ROWS * g
            if row < rows:
                for j in cutlass.range_constexpr(per_thread):
                    incoming[segment, head, row, col0 + 16 * j] = acc[g, j]
