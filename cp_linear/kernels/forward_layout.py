"""The chunk and segment tables of a packed shard in one launch (``launch.forward_layout``'s tables,
value for value; that array-API function is this kernel's reference and emulation).

Built with array operations the tables cost about twenty small launches (and as many host dispatches)
per forward; here one. Every CTA first scans the sequences (``cu_seqlens``, N <= ``LAYOUT_MAX_SEQUENCES``)
into shared memory: token bounds, chunk offsets (exclusive prefix sums of each sequence's chunk count)
and first segments (the same of its segment count), ``LAYOUT_THREADS`` sequences per round with warp
shuffle scans. CTA 0 writes the per-sequence tables. Then each thread fills ``LAYOUT_ENTRIES_PER_THREAD``
entries of the chunk tables or the segment tables, finding its entry's sequence by binary search in
shared memory (as ``chunking.bounds_after_first``: entries past the real ones land on the last sequence).

``summary_sequence``: -1 none, ``TRAILING_SEQUENCE`` the last sequence with tokens (found here from the
first segments, and written to ``trailing``: 0 when no sequence has tokens), else that index.
``seg_order`` (``ForwardLayout.seg_order``): a whole segment's slot is its index minus the shorter last
segments before it (a third prefix sum of the first pass); a shorter one's counts the longer last segments
over all sequences (up to ``LAYOUT_SORT_SEQUENCES``; beyond, sequence order). ``grad_summary_sequence``: -1
none, else that index. ``values_only_from``: -1 none, else the first sequence
whose summarised first segment also carries ``VALUES_ONLY_FLAG``. The caller folds the single-sequence rules of
``forward_layout`` into ``every_segment_summary`` / ``every_segment_grad_summary``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cp_linear.kernels.configs import FORWARD_TRANSITION_FLAG, VALUES_ONLY_FLAG, ForwardLayoutConfig
from cp_linear.kernels.configs import LAYOUT_ENTRIES_PER_THREAD as PER_THREAD
from cp_linear.kernels.configs import LAYOUT_MAX_SEQUENCES as MAX_SEQUENCES
from cp_linear.kernels.configs import LAYOUT_SORT_SEQUENCES as SORT_SEQUENCES
from cp_linear.kernels.configs import LAYOUT_THREADS as THREADS
from cp_linear.kernels.configs import TRAILING_SEQUENCE

WARPS = THREADS // 32
SEARCH_STEPS = (MAX_SEQUENCES + 1).bit_length()  # halvings of up to N + 1 bounds down to none


@cute.jit
def _last_at_most(bounds: cute.Tensor, count, value, last):
    """clip(#{i < count: bounds[i] <= value} - 1, 0, last) for nondecreasing ``bounds`` (branch-free
    binary search: a finished search keeps its bounds)."""
    low = Int32(0)
    high = count
    for _ in cutlass.range_constexpr(SEARCH_STEPS):
        active = low < high
        mid = (low + high) // 2
        probe = bounds[cutlass.min(mid, count - 1)]
        low = cutlass.select_(active & (probe <= value), mid + 1, low)
        high = cutlass.select_(active & (probe > value), mid, high)
    return cutlass.max(cutlass.min(low - 1, last), 0)


class ForwardLayoutKernel:
    def __init__(self, config: ForwardLayoutConfig):
        config.validate()

    @cute.jit
    def __call__(self,
                 cu_seqlens: cute.Tensor,  # int32 [N + 1]
                 chunk_first_step: cute.Tensor,  # int32 [C_max] (out, as the rest)
                 chunk_steps: cute.Tensor,  # int32 [C_max]
                 num_chunks: cute.Tensor,  # int32 [1]
                 seq_first_segment: cute.Tensor,  # int32 [N + 1]
                 seq_segments: cute.Tensor,  # int32 [N]
                 seg_first_chunk: cute.Tensor,  # int32 [S_max]
                 seg_chunks: cute.Tensor,  # int32 [S_max]
                 seg_flags: cute.Tensor,  # int32 [S_max]
                 num_segments: cute.Tensor,  # int32 [1]
                 seg_grad_flags: cute.Tensor,  # int32 [S_max]
                 seg_order: cute.Tensor,  # int32 [S_max]
                 trailing: cute.Tensor,  # int32 [1]: the last sequence with tokens
                 num_householder: Int32, tokens_per_chunk: Int32, segment_chunks: Int32, summary_sequence: Int32,
                 grad_summary_sequence: Int32, every_segment_summary: Int32, every_segment_grad_summary: Int32,
                 values_only_from: Int32, stream):
        per_cta = THREADS * PER_THREAD
        entries = chunk_first_step.shape[0] + seg_first_chunk.shape[0]
        self.kernel(cu_seqlens, chunk_first_step, chunk_steps, num_chunks, seq_first_segment, seq_segments,
                    seg_first_chunk, seg_chunks, seg_flags, num_segments, seg_grad_flags, seg_order, trailing,
                    num_householder,
                    tokens_per_chunk, segment_chunks, summary_sequence, grad_summary_sequence, every_segment_summary,
                    every_segment_grad_summary, values_only_from).launch(
                        grid=((entries + per_cta - 1) // per_cta, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, cu_seqlens: cute.Tensor, chunk_first_step: cute.Tensor, chunk_steps: cute.Tensor,
               num_chunks: cute.Tensor, seq_first_segment: cute.Tensor, seq_segments: cute.Tensor,
               seg_first_chunk: cute.Tensor, seg_chunks: cute.Tensor, seg_flags: cute.Tensor,
               num_segments: cute.Tensor, seg_grad_flags: cute.Tensor, seg_order: cute.Tensor, trailing: cute.Tensor,
               num_householder: Int32, tokens_per_chunk: Int32, segment_chunks: Int32, summary_sequence: Int32,
               grad_summary_sequence: Int32, every_segment_summary: Int32, every_segment_grad_summary: Int32,
               values_only_from: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        allocator = cutlass.utils.SmemAllocator()
        bounds_layout = cute.make_layout((MAX_SEQUENCES + 1,))
        s_cu = allocator.allocate_tensor(Int32, bounds_layout, 16)
        s_chunk_offset = allocator.allocate_tensor(Int32, bounds_layout, 16)
        s_first_segment = allocator.allocate_tensor(Int32, bounds_layout, 16)
        # sequences before n whose last segment is shorter than a whole one (seg_order's whole-segment slots)
        s_partials_before = allocator.allocate_tensor(Int32, bounds_layout, 16)
        s_warp_totals = allocator.allocate_tensor(Int32, cute.make_layout((3, WARPS), stride=(WARPS, 1)), 16)
        sequences = cu_seqlens.shape[0] - 1

        # the sequences, THREADS per round: lengths -> chunk and segment counts -> their prefix sums
        if tidx == 0:
            s_cu[0] = cu_seqlens[0]
            s_chunk_offset[0] = Int32(0)
            s_first_segment[0] = Int32(0)
            s_partials_before[0] = Int32(0)
        chunks_before = Int32(0)
        segments_before = Int32(0)
        partials_before = Int32(0)
        for round_start in range(0, sequences, THREADS):
            n = round_start + tidx
            inside = n < sequences
            clamped = cutlass.min(n, sequences - 1)
            end = cu_seqlens[clamped + 1]
            length = cutlass.select_(inside, end - cu_seqlens[clamped], Int32(0))
            chunks = (length + tokens_per_chunk - 1) // tokens_per_chunk
            segments = (chunks + segment_chunks - 1) // segment_chunks
            partial = cutlass.select_(chunks % segment_chunks != 0, Int32(1), Int32(0))
            chunk_scan, segment_scan, partial_scan = chunks, segments, partial
            for d in cutlass.range_constexpr(5):
                chunk_up = cute.arch.shuffle_sync_up(chunk_scan, 1 << d)
                segment_up = cute.arch.shuffle_sync_up(segment_scan, 1 << d)
                partial_up = cute.arch.shuffle_sync_up(partial_scan, 1 << d)
                chunk_scan = chunk_scan + cutlass.select_(lane >= (1 << d), chunk_up, Int32(0))
                segment_scan = segment_scan + cutlass.select_(lane >= (1 << d), segment_up, Int32(0))
                partial_scan = partial_scan + cutlass.select_(lane >= (1 << d), partial_up, Int32(0))
            if lane == 31:
                s_warp_totals[0, warp] = chunk_scan
                s_warp_totals[1, warp] = segment_scan
                s_warp_totals[2, warp] = partial_scan
            cute.arch.sync_threads()
            chunk_round, segment_round, partial_round = Int32(0), Int32(0), Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                earlier = w < warp
                chunk_scan = chunk_scan + cutlass.select_(earlier, s_warp_totals[0, w], Int32(0))
                segment_scan = segment_scan + cutlass.select_(earlier, s_warp_totals[1, w], Int32(0))
                partial_scan = partial_scan + cutlass.select_(earlier, s_warp_totals[2, w], Int32(0))
                chunk_round = chunk_round + s_warp_totals[0, w]
                segment_round = segment_round + s_warp_totals[1, w]
                partial_round = partial_round + s_warp_totals[2, w]
            if inside:
                s_cu[n + 1] = end
                s_chunk_offset[n + 1] = chunks_before + chunk_scan
                s_first_segment[n + 1] = segments_before + segment_scan
                s_partials_before[n + 1] = partials_before + partial_scan
                if block == 0:
                    seq_segments[n] = segments
                    seq_first_segment[n + 1] = segments_before + segment_scan
            chunks_before = chunks_before + chunk_round
            segments_before = segments_before + segment_round
            partials_before = partials_before + partial_round
            cute.arch.sync_threads()  # the warp totals are rewritten next round; the bounds are complete after it
        # the last sequence with tokens owns the last real segment (none: the search gives 0)
        last_nonempty = _last_at_most(s_first_segment, sequences + 1, segments_before - 1, sequences - 1)
        if (block == 0) & (tidx == 0):
            seq_first_segment[0] = Int32(0)
            num_chunks[0] = chunks_before
            num_segments[0] = segments_before
            trailing[0] = last_nonempty
        summarised_sequence = cutlass.select_(summary_sequence == TRAILING_SEQUENCE, last_nonempty, summary_sequence)

        chunk_slots = chunk_first_step.shape[0]
        segment_slots = seg_first_chunk.shape[0]
        for j in cutlass.range_constexpr(PER_THREAD):
            entry = block * (THREADS * PER_THREAD) + j * THREADS + tidx
            if entry < chunk_slots:
                chunk = entry
                sequence = _last_at_most(s_chunk_offset, sequences + 1, chunk, sequences - 1)
                first_token = (chunk - s_chunk_offset[sequence]) * tokens_per_chunk
                start = s_cu[sequence]
                length = s_cu[sequence + 1] - start
                # zero past the real chunks (there first_token >= the last sequence's length)
                real = chunk < chunks_before
                chunk_first_step[chunk] = cutlass.select_(real, (start + first_token) * num_householder, Int32(0))
                chunk_steps[chunk] = cutlass.max(cutlass.min(length - first_token, tokens_per_chunk),
                                                 Int32(0)) * num_householder
            elif entry < chunk_slots + segment_slots:
                segment = entry - chunk_slots
                sequence = _last_at_most(s_first_segment, sequences + 1, segment, sequences - 1)
                segment_index = segment - s_first_segment[sequence]
                first_chunk_in_sequence = segment_index * segment_chunks
                real = segment < segments_before
                seg_first_chunk[segment] = cutlass.select_(real, s_chunk_offset[sequence] + first_chunk_in_sequence,
                                                           Int32(0))
                chunks_left = s_chunk_offset[sequence + 1] - s_chunk_offset[sequence] - first_chunk_in_sequence
                seg_chunks[segment] = cutlass.max(cutlass.min(chunks_left, segment_chunks), Int32(0))
                # followed by another segment of its sequence, or of the summarised sequence, or every one
                summarised = chunks_left > segment_chunks
                summarised = cutlass.select_(summarised_sequence >= 0,
                                             real & (summarised | (sequence == summarised_sequence)), summarised)
                summarised = cutlass.select_(every_segment_summary != 0, real, summarised)
                flag = cutlass.select_(summarised, Int32(1), Int32(0))
                values_only = (values_only_from >= 0) & (segment_index == 0) & (sequence >= values_only_from)
                seg_flags[segment] = flag + cutlass.select_(summarised & values_only, Int32(VALUES_ONLY_FLAG),
                                                            Int32(0))
                preceded = (segment_index >= 1) | ((grad_summary_sequence >= 0) & (sequence == grad_summary_sequence))
                grad_summarised = cutlass.select_(every_segment_grad_summary != 0, real, real & preceded)
                seg_grad_flags[segment] = cutlass.select_(grad_summarised, 1 + FORWARD_TRANSITION_FLAG * flag, Int32(0))
                # seg_order: whole segments take the first slots in order; a shorter last segment follows
                # every whole one, after the longer last segments (and equal ones of earlier sequences)
                length = cutlass.max(cutlass.min(chunks_left, segment_chunks), Int32(0))
                whole = length == segment_chunks
                rank = s_partials_before[sequence]  # beyond SORT_SEQUENCES: sequence order
                if real & (length < segment_chunks) & (sequences <= SORT_SEQUENCES):
                    rank = Int32(0)
                    for m in range(sequences):
                        other = (s_chunk_offset[m + 1] - s_chunk_offset[m]) % segment_chunks
                        before = (other > length) | ((other == length) & (m < sequence))
                        rank = rank + cutlass.select_(before, Int32(1), Int32(0))
                slot = cutlass.select_(whole, segment - s_partials_before[sequence],
                                       segments_before - partials_before + rank)
                seg_order[cutlass.select_(real, slot, segment)] = segment
