"""The GDP backward scans on tensor cores (warp ``mma.sync``).

The algebra is ``backward_algorithm`` (checked against autograd); ``emulation_backward`` runs these
launches in torch. The state gradient is held transposed like the forward state, dX = dS^T
[V, K], warp w owning rows [16 w, 16 w + 16); its rows evolve independently. Per chunk, with
Qc = diag(c) q formed in shared memory from the q tile:

    dD = (dX k^T) diag(b) + dO^T P          Z = dD Ta          dX <- d dX + dO^T Qc - Z k

The backward splits as flash-linear-attention's does: a sequential pass carries only dX, and
everything else runs chunk-parallel from what the sequential passes stored.

* ``ChunkGammaKernel``: a segment's backward summary rows [gamma ; M_b] (dX_in = dX_out M_b +
  gamma) from [0 ; I], chunks in reverse; the transition rows see a zero dO tile. M_b is the
  forward summary's transition rows transposed, so segments flagged ``FORWARD_TRANSITION_FLAG``
  get only their gamma rows scanned; their transition CTAs copy the forward's rows, transposed.
* ``ChunkReverseScanKernel``: one CTA per (segment, head, row block) from the segment's outgoing
  gradient, storing rnd(dX) at every chunk's end and the segment's incoming gradient.
* ``ChunkReverseKernel``: one CTA per (chunk, head) holding all V rows, from the chunk's start
  state (``chunk_scan`` mode "states") and end gradient: writes dv, the scan's parts of dq and
  dk, and the gradients of Ta, Tb, P and the chunk scalars (for ``chunk_prep_backward``). Sums
  over value rows (db, dc, dd, the products with rows = steps) stay inside the CTA and run in a
  fixed order, so gradients are bitwise repeatable.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cp_linear.kernels import _chunk_common as chunk_common
from cp_linear.kernels import _mma
from cp_linear.kernels._common import cutlass_dtype
from cp_linear.kernels.chunk_scan import _scaled_as_a, staged_tile
from cp_linear.kernels.configs import (
    CHUNK_SIZE,
    FORWARD_TRANSITION_FLAG,
    SUMMARY_FLAG,
    ChunkGammaConfig,
    ChunkReverseConfig,
    ChunkReverseScanConfig,
)

C = CHUNK_SIZE
STAGES = 2


@cute.jit
def scale_rows_into(src: cute.Tensor, dst: cute.Tensor, scales: cute.Tensor, tidx, threads: cutlass.Constexpr,
                    rows: cutlass.Constexpr, cols: cutlass.Constexpr, dtype: cutlass.Constexpr):
    """dst[r, c] = round(scales[r] * src[r, c]) for a [rows, cols] shared tile, all threads."""
    for i in cutlass.range_constexpr(rows * cols // threads):
        flat = tidx + i * threads
        r = flat // cols
        c = flat % cols
        dst[r, c] = (src[r, c].to(Float32) * scales[r]).to(dtype)


class _GradientRowsKernel:
    """Rows of a state gradient carried through a segment's chunks in reverse (``gamma_step`` per
    chunk), the next chunk's tiles fetched with cp.async into the other shared-memory stage."""

    def __init__(self, config, rows: int):
        config.validate()
        self.dtype = cutlass_dtype(config.dtype)
        self.key_dim = config.key_dim
        self.value_dim = config.value_dim
        self.query_tile = config.query_tile
        self.rows = rows
        self.warps = self.rows // 16
        self.threads = 32 * self.warps
        self.wgmma = config.mma == "wgmma"
        self.contained = config.contained

    @cute.jit
    def load_chunk(self, g2s, tidx, chunk, head, value_col, is_value_rows, k, q, do, ta, p, chunk_first_step,
                   chunk_steps, s_k, s_q, s_do, s_ta, s_p, num_householder):
        """Issue one chunk's copies into one stage."""
        K, R, NQ = self.key_dim, self.rows, self.query_tile
        first = chunk_first_step[chunk]
        steps = chunk_steps[chunk]
        first_token = first // num_householder
        tokens = steps // num_householder
        _mma.copy_rows_g2s(g2s, tidx, cute.local_tile(cute.domain_offset((first, 0), k[None, head, None]), (C, K),
                                                      (0, 0)), s_k, steps)
        _mma.copy_rows_g2s(g2s, tidx, cute.local_tile(cute.domain_offset((first_token, 0), q[None, head, None]),
                                                      (NQ, K), (0, 0)), s_q, tokens)
        if is_value_rows:
            g_do = cute.local_tile(cute.domain_offset((first_token, value_col), do[None, head, None]), (NQ, R),
                                   (0, 0))
            _mma.copy_rows_g2s(g2s, tidx, g_do, s_do, tokens)
        _mma.copy_rows_g2s(g2s, tidx, ta[chunk, head, None, None], s_ta, C)
        _mma.copy_rows_g2s(g2s, tidx, p[chunk, head, None, None], s_p, NQ)
        cute.arch.cp_async_commit_group()

    def allocate(self, stores_grads: bool):
        """The staged shared tiles of k, q, dO, Ta, P, the scalars, Qc (and the gradient's staging)."""
        K, R, NQ = self.key_dim, self.rows, self.query_tile
        allocator = cutlass.utils.SmemAllocator()
        staged = lambda rows, cols: staged_tile(allocator, self.dtype, rows, cols, self.wgmma)  # noqa: E731
        if cutlass.const_expr(self.wgmma):
            qc = _mma.wgmma_tile(allocator, self.dtype, NQ, K)
        else:
            qc = allocator.allocate_tensor(self.dtype, _mma.smem_tile_layout(NQ, K), 128)
        return dict(
            s_k_all=staged(C, K),
            s_q_all=staged(NQ, K),
            s_qc=qc,
            s_do_all=staged(NQ, R),
            s_ta_all=staged(C, C),
            s_p_all=staged(NQ, C),
            s_scalars=allocator.allocate_tensor(Float32, cute.make_layout((4, C, STAGES), stride=(C, 1, 4 * C)), 16),
            # the gradient rows on their way to chunk_grads (only the reverse scan stores them)
            s_out=allocator.allocate_tensor(self.dtype, _mma.smem_tile_layout(R, K), 128) if stores_grads else None)

    @cute.jit
    def reverse_chunks(self, tiled_mma, g2s, s2g, tidx, grad, grad_coords, k, q, do, ta, p, scalars, chunk_first_step,
                       chunk_steps, head, first_chunk, chunk_count, row0, value_col, is_value_rows, num_householder,
                       s_k_all, s_q_all, s_qc, s_do_all, s_ta_all, s_p_all, s_scalars, s_out, chunk_grads,
                       store_grads: cutlass.Constexpr, flags):
        """grad <- the segment's chunks applied in reverse; with ``store_grads``, rnd(grad) at each
        chunk's end goes to ``chunk_grads[chunk, head, row0 + r]`` first."""
        K, R, NQ, NH = self.key_dim, self.rows, self.query_tile, num_householder
        step_coords = self.coordinates(tiled_mma, tidx, C)
        grad_mma = self.gradient_mma(tiled_mma)  # grad's C layout, for its stmatrix staging
        last_chunk = first_chunk + chunk_count - 1
        self.load_chunk(g2s, tidx, last_chunk, head, value_col, is_value_rows, k, q, do, ta, p,
                        chunk_first_step, chunk_steps, s_k_all[None, None, 0], s_q_all[None, None, 0],
                        s_do_all[None, None, 0], s_ta_all[None, None, 0], s_p_all[None, None, 0], NH)
        per_thread = 4 * C // self.threads
        scalar_next = cute.make_rmem_tensor(cute.make_layout((per_thread,)), Float32)
        for j in cutlass.range_constexpr(per_thread):
            index = tidx + j * self.threads
            scalar_next[j] = scalars[last_chunk, head, index // C, index % C]
        for it in range(chunk_count):
            stage = it % STAGES
            chunk = last_chunk - it
            for j in cutlass.range_constexpr(per_thread):
                index = tidx + j * self.threads
                s_scalars[index // C, index % C, stage] = scalar_next[j]
            if cutlass.const_expr(store_grads):  # staged, then stored as whole rows after the sync below
                _mma.stage_accumulator_stmatrix(grad_mma, tidx, grad, s_out)
            cute.arch.cp_async_wait_group(0)
            if cutlass.const_expr(self.contained):  # k rows of state_bad tokens, q and dO rows of read_bad ones
                # (transition rows load no dO tile and read none: zeroing rows of it changes nothing)
                chunk_common.zero_flagged_chunk_rows(g2s, tidx, flags, head, chunk_first_step[chunk] // NH,
                                                     chunk_steps[chunk], NH, K, NQ, s_k_all[None, None, stage],
                                                     s_q=s_q_all[None, None, stage], s_do=s_do_all[None, None, stage])
            if cutlass.const_expr(self.wgmma):
                cute.arch.fence_view_async_shared()  # cp.async data -> the tensor cores' reads
            cute.arch.sync_threads()
            if cutlass.const_expr(store_grads):  # s_out is rewritten after the loop's last sync
                _mma.copy_tile_s2g(s2g, tidx, s_out, cute.local_tile(chunk_grads[chunk, head, None, None], (R, K),
                                                                     (row0 // R, 0)))
            if it + 1 < chunk_count:
                other = 1 - stage
                self.load_chunk(g2s, tidx, chunk - 1, head, value_col, is_value_rows, k, q, do, ta, p,
                                chunk_first_step, chunk_steps, s_k_all[None, None, other],
                                s_q_all[None, None, other], s_do_all[None, None, other],
                                s_ta_all[None, None, other], s_p_all[None, None, other], NH)
                for j in cutlass.range_constexpr(per_thread):
                    index = tidx + j * self.threads
                    scalar_next[j] = scalars[chunk - 1, head, index // C, index % C]
            s_sc = s_scalars[None, None, stage]
            scale_rows_into(s_q_all[None, None, stage], s_qc, s_sc[1, None], tidx, self.threads, NQ, K,
                            self.dtype)
            if cutlass.const_expr(self.wgmma):
                cute.arch.fence_view_async_shared()  # Qc written by threads -> the tensor cores' reads
            cute.arch.sync_threads()
            step = gamma_step_wgmma if cutlass.const_expr(self.wgmma) else gamma_step
            step(tiled_mma, tidx, grad, step_coords, s_sc, s_k_all[None, None, stage], s_do_all[None, None, stage],
                 s_ta_all[None, None, stage], s_p_all[None, None, stage], s_qc, self.dtype, R, K, NQ)
            cute.arch.sync_threads()  # s_qc is rewritten by the next chunk

    def coordinates(self, tiled_mma, tidx, cols: int) -> cute.Tensor:
        """(row, column) of each accumulator element of an [R, cols] product (the C layout of either family)."""
        if cutlass.const_expr(self.wgmma):
            thr = _mma.make_wgmma(self.dtype, self.rows // 64, cols).get_slice(tidx)
        else:
            thr = tiled_mma.get_slice(tidx)
        return thr.partition_C(cute.make_identity_tensor((self.rows, cols)))

    def gradient_mma(self, tiled_mma):
        """The MMA whose C layout holds the gradient rows [R, K] (``tiled_mma`` for mma.sync)."""
        if cutlass.const_expr(self.wgmma):
            return _mma.make_wgmma(self.dtype, self.rows // 64, self.key_dim)
        return tiled_mma

    def gradient(self, tiled_mma, tidx):
        """The float32 gradient rows [R, K] as an accumulator (uninitialised) and their coordinates."""
        if cutlass.const_expr(self.wgmma):
            thr = self.gradient_mma(tiled_mma).get_slice(tidx)
            grad = thr.make_fragment_C(thr.partition_shape_C((self.rows, self.key_dim)))
        else:
            grad = cute.make_rmem_tensor(tiled_mma.get_slice(tidx).partition_shape_C((self.rows, self.key_dim)),
                                         Float32)
        return grad, self.coordinates(tiled_mma, tidx, self.key_dim)


class ChunkGammaKernel(_GradientRowsKernel):
    def __init__(self, config: ChunkGammaConfig):
        super().__init__(config, config.rows_per_cta)

    @cute.jit
    def __call__(self,
                 k: cute.Tensor,  # [S_all, H, K] input dtype
                 q: cute.Tensor,  # [T_all, H, K] input dtype
                 do: cute.Tensor,  # [T_all, H, V] input dtype (the output gradient)
                 ta: cute.Tensor,  # [C_max, H, 64, 64] input dtype
                 p: cute.Tensor,  # [C_max, H, NQ, 64] input dtype
                 scalars: cute.Tensor,  # [C_max, H, 4, 64] float32
                 chunk_first_step: cute.Tensor, chunk_steps: cute.Tensor,  # int32 [C_max]
                 seg_first_chunk: cute.Tensor, seg_chunks: cute.Tensor,  # int32 [S_max]
                 seg_order: cute.Tensor, seg_flags: cute.Tensor,  # int32 [S_max]
                 num_segments: cute.Tensor,  # int32 [1]
                 forward_summaries: cute.Tensor,  # [S_max, H, V + K, K] float32: the forward's [E^T ; M^T] rows
                 state_bad: cute.Tensor, read_bad: cute.Tensor,  # [T_all, H] uint8 (read when contained)
                 any_flagged: cute.Tensor,  # int32 [1]: nonzero when any token is flagged (contained)
                 summaries: cute.Tensor,  # [S_max, H, V + K, K] float32 (out): rows [gamma ; M_b]
                 num_householder: Int32, stream):
        tiled_mma = _mma.make_tiled_mma(self.dtype, self.warps)
        g2s = _mma.make_g2s_copy(self.dtype, self.threads)
        self.kernel(k, q, do, ta, p, scalars, chunk_first_step, chunk_steps, seg_first_chunk, seg_chunks, seg_order,
                    seg_flags, num_segments, forward_summaries, state_bad, read_bad, any_flagged, summaries,
                    num_householder,
                    tiled_mma, g2s).launch(
            grid=(k.shape[1], seg_first_chunk.shape[0], (self.value_dim + self.key_dim) // self.rows),
            block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, k: cute.Tensor, q: cute.Tensor, do: cute.Tensor, ta: cute.Tensor, p: cute.Tensor,
               scalars: cute.Tensor, chunk_first_step: cute.Tensor, chunk_steps: cute.Tensor,
               seg_first_chunk: cute.Tensor, seg_chunks: cute.Tensor, seg_order: cute.Tensor,
               seg_flags: cute.Tensor, num_segments: cute.Tensor, forward_summaries: cute.Tensor,
               state_bad: cute.Tensor, read_bad: cute.Tensor, any_flagged: cute.Tensor, summaries: cute.Tensor,
               num_householder: Int32, tiled_mma: cute.TiledMma, g2s: cute.TiledCopy):
        V, R, NQ = self.value_dim, self.rows, self.query_tile
        tidx, _, _ = cute.arch.thread_idx()
        head, slot, row_block = cute.arch.block_idx()  # heads fastest: CTAs start in slot order
        segment = seg_order[slot]  # longest segments first (forward_layout's seg_order)
        smem = self.allocate(False)

        flags = seg_flags[cutlass.min(segment, seg_flags.shape[0] - 1)]
        row0 = row_block * R
        is_value_rows = row0 < V
        summarised = (segment < num_segments[0]) & ((flags & SUMMARY_FLAG) != 0)
        # transition rows the forward already summarised are its M^T rows transposed (M_b^T = M), copied from
        # its saved summary, not scanned: these CTAs run beside the scanning ones (the copy a separate launch
        # would make). A thread reads 4 adjacent columns of forward row V + c (16 bytes) and writes them down
        # column c of 4 rows; the lanes of a warp take adjacent c, so each of its 4 stores is one 128-byte row
        from_forward = (flags & FORWARD_TRANSITION_FLAG) != 0
        if summarised & (row0 >= V) & from_forward:
            K = self.key_dim
            assert R * K // 4 % self.threads == 0  # every 16-byte piece once (threads = 2 R)
            piece = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
            for i in cutlass.range_constexpr(R * K // 4 // self.threads):
                flat = i * self.threads + tidx
                column, row_group = flat % K, flat // K
                source = forward_summaries[segment, head, V + column, None]
                piece.store(cute.local_tile(source, (4,), ((row0 - V) // 4 + row_group,)).load())
                for e in cutlass.range_constexpr(4):
                    summaries[segment, head, row0 + row_group * 4 + e, column] = piece[e]
        if summarised & (is_value_rows | ((flags & FORWARD_TRANSITION_FLAG) == 0)):
            value_col = cute.assume(cutlass.min(row0, V - R), divby=64)
            grad, grad_coords = self.gradient(tiled_mma, tidx)
            for e in cutlass.range_constexpr(cute.size(grad)):
                r, c = grad_coords[e]
                grad[e] = Float32(0.0)
                if (row0 + r - V) == c:
                    grad[e] = Float32(1.0)
            if not is_value_rows:  # transition rows: a zero dO tile in both stages, never loaded
                elements = NQ * R * STAGES
                flat = cute.make_tensor(smem["s_do_all"].iterator, cute.make_layout(elements))
                for i in cutlass.range(elements // self.threads, unroll=8):
                    flat[tidx + i * self.threads] = self.dtype(0.0)
            self.reverse_chunks(tiled_mma, g2s, None, tidx, grad, grad_coords, k, q, do, ta, p, scalars,
                                chunk_first_step, chunk_steps, head, seg_first_chunk[segment], seg_chunks[segment],
                                row0, value_col, is_value_rows, num_householder, smem["s_k_all"], smem["s_q_all"],
                                smem["s_qc"], smem["s_do_all"], smem["s_ta_all"], smem["s_p_all"], smem["s_scalars"],
                                None, None, False, chunk_common.contained_flags(self, state_bad, read_bad, any_flagged))
            for e in cutlass.range_constexpr(cute.size(grad)):
                r, c = grad_coords[e]
                summaries[segment, head, row0 + r, c] = grad[e]


class ChunkReverseScanKernel(_GradientRowsKernel):
    def __init__(self, config: ChunkReverseScanConfig):
        super().__init__(config, config.rows_per_cta)

    @cute.jit
    def __call__(self,
                 k: cute.Tensor, q: cute.Tensor, do: cute.Tensor, ta: cute.Tensor, p: cute.Tensor,
                 scalars: cute.Tensor,  # as in ChunkGammaKernel
                 chunk_first_step: cute.Tensor, chunk_steps: cute.Tensor,  # int32 [C_max]
                 seg_first_chunk: cute.Tensor, seg_chunks: cute.Tensor, seg_order: cute.Tensor,  # int32 [S_max]
                 num_segments: cute.Tensor,  # int32 [1]
                 grad_out: cute.Tensor,  # [S_max, H, V, K] float32: each segment's outgoing state gradient
                 state_bad: cute.Tensor, read_bad: cute.Tensor,  # [T_all, H] uint8 (read when contained)
                 any_flagged: cute.Tensor,  # int32 [1]: nonzero when any token is flagged (contained)
                 chunk_grads: cute.Tensor,  # [C_max, H, V, K] input dtype (out): the gradient at each chunk's end
                 grad_in: cute.Tensor,  # [S_max, H, V, K] float32 (out): the gradient at each segment's start
                 num_householder: Int32, stream):
        tiled_mma = _mma.make_tiled_mma(self.dtype, self.warps)
        g2s = _mma.make_g2s_copy(self.dtype, self.threads)
        s2g = _mma.make_s2g_copy(self.dtype, self.threads)
        self.kernel(k, q, do, ta, p, scalars, chunk_first_step, chunk_steps, seg_first_chunk, seg_chunks, seg_order,
                    num_segments, grad_out, state_bad, read_bad, any_flagged, chunk_grads, grad_in, num_householder,
                    tiled_mma, g2s,
                    s2g).launch(
            grid=(k.shape[1], seg_first_chunk.shape[0], self.value_dim // self.rows),
            block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, k: cute.Tensor, q: cute.Tensor, do: cute.Tensor, ta: cute.Tensor, p: cute.Tensor,
               scalars: cute.Tensor, chunk_first_step: cute.Tensor, chunk_steps: cute.Tensor,
               seg_first_chunk: cute.Tensor, seg_chunks: cute.Tensor, seg_order: cute.Tensor,
               num_segments: cute.Tensor, grad_out: cute.Tensor, state_bad: cute.Tensor, read_bad: cute.Tensor,
               any_flagged: cute.Tensor,
               chunk_grads: cute.Tensor, grad_in: cute.Tensor, num_householder: Int32,
               tiled_mma: cute.TiledMma, g2s: cute.TiledCopy, s2g: cute.TiledCopy):
        R = self.rows
        tidx, _, _ = cute.arch.thread_idx()
        head, slot, row_block = cute.arch.block_idx()  # heads fastest: CTAs start in slot order
        segment = seg_order[slot]  # longest segments first (forward_layout's seg_order)
        smem = self.allocate(True)
        if segment < num_segments[0]:
            row0 = row_block * R
            value_col = cute.assume(row0, divby=64)
            grad, grad_coords = self.gradient(tiled_mma, tidx)
            for e in cutlass.range_constexpr(cute.size(grad)):
                r, c = grad_coords[e]
                grad[e] = grad_out[segment, head, row0 + r, c]
            self.reverse_chunks(tiled_mma, g2s, s2g, tidx, grad, grad_coords, k, q, do, ta, p, scalars,
                                chunk_first_step, chunk_steps, head, seg_first_chunk[segment], seg_chunks[segment],
                                row0, value_col, True, num_householder, smem["s_k_all"], smem["s_q_all"],
                                smem["s_qc"], smem["s_do_all"], smem["s_ta_all"], smem["s_p_all"], smem["s_scalars"],
                                smem["s_out"], chunk_grads, True,
                                chunk_common.contained_flags(self, state_bad, read_bad, any_flagged))
            for e in cutlass.range_constexpr(cute.size(grad)):
                r, c = grad_coords[e]
                grad_in[segment, head, row0 + r, c] = grad[e]


def _b_operand(tiled_mma, tidx, tile, dtype, transpose: bool):
    return _mma.SmemOperand(tiled_mma, tidx, tile, dtype, operand="B", transpose=transpose)


@cute.jit
def gamma_step(tiled_mma, tidx, grad: cute.Tensor, step_coords: cute.Tensor, s_sc: cute.Tensor, s_k: cute.Tensor,
               s_do: cute.Tensor, s_ta: cute.Tensor, s_p: cute.Tensor, s_qc: cute.Tensor, dtype: cutlass.Constexpr,
               R: cutlass.Constexpr, K: cutlass.Constexpr, NQ: cutlass.Constexpr):
    """grad <- d grad + dO^T Qc - ((grad k^T) diag(b) + dO^T P) Ta k, in place (one chunk)."""
    thr_mma = tiled_mma.get_slice(tidx)
    grad_a = _mma.accumulator_as_a(grad, dtype)
    delta = cute.make_rmem_tensor(thr_mma.partition_shape_C((R, C)), Float32)
    delta.fill(0.0)
    _mma.gemm_smem_b(tiled_mma, delta, grad_a, _b_operand(tiled_mma, tidx, s_k, dtype, False))
    for e in cutlass.range_constexpr(cute.size(delta)):
        delta[e] = delta[e] * s_sc[0, step_coords[e][1]]
    do_t = _mma.SmemOperand(tiled_mma, tidx, _mma.transposed_view(s_do, NQ, R), dtype, operand="A", transpose=True)
    _mma.gemm_smem_ab(tiled_mma, delta, do_t, _b_operand(tiled_mma, tidx, _mma.transposed_view(s_p, NQ, C), dtype, True))
    z = cute.make_rmem_tensor(thr_mma.partition_shape_C((R, C)), Float32)
    z.fill(0.0)
    _mma.gemm_smem_b(tiled_mma, z, _mma.accumulator_as_a(delta, dtype),
                     _b_operand(tiled_mma, tidx, _mma.transposed_view(s_ta, C, C), dtype, True))
    decay = s_sc[2, 0]
    for e in cutlass.range_constexpr(cute.size(grad)):
        grad[e] = grad[e] * decay
    do_t2 = _mma.SmemOperand(tiled_mma, tidx, _mma.transposed_view(s_do, NQ, R), dtype, operand="A", transpose=True)
    _mma.gemm_smem_ab(tiled_mma, grad, do_t2, _b_operand(tiled_mma, tidx, _mma.transposed_view(s_qc, NQ, K), dtype, True))
    minus_z = _scaled_as_a(z, lambda e: Float32(-1.0), dtype)
    _mma.gemm_smem_b(tiled_mma, grad, minus_z, _b_operand(tiled_mma, tidx, _mma.transposed_view(s_k, C, K), dtype, True))


@cute.jit
def gamma_step_wgmma(tiled_mma, tidx, grad: cute.Tensor, step_coords: cute.Tensor, s_sc: cute.Tensor,
                     s_k: cute.Tensor, s_do: cute.Tensor, s_ta: cute.Tensor, s_p: cute.Tensor, s_qc: cute.Tensor,
                     dtype: cutlass.Constexpr, R: cutlass.Constexpr, K: cutlass.Constexpr, NQ: cutlass.Constexpr):
    """``gamma_step`` on warpgroup MMAs (``tiled_mma`` unused): B operands, and dO^T as A, read by the tensor
    cores from the ``wgmma_tile_layout`` tiles; tiles needed transposed are read MN-major."""
    groups = R // 64
    transposed = lambda tile, rows, cols: _mma.wgmma_transposed(tile, dtype, rows, cols)  # noqa: E731
    by_step = _mma.make_wgmma(dtype, groups, C)  # delta = grad k^T
    do_p = _mma.make_wgmma(dtype, groups, C, a_from_smem=True, a_mn_major=True, b_mn_major=True)  # += dO^T P
    by_ta = _mma.make_wgmma(dtype, groups, C, b_mn_major=True)  # Z = delta Ta
    do_qc = _mma.make_wgmma(dtype, groups, K, a_from_smem=True, a_mn_major=True, b_mn_major=True)  # += dO^T Qc
    by_k = _mma.make_wgmma(dtype, groups, K, b_mn_major=True)  # -= Z k
    thr_step, thr_do_p, thr_ta = by_step.get_slice(tidx), do_p.get_slice(tidx), by_ta.get_slice(tidx)
    thr_do_qc, thr_k = do_qc.get_slice(tidx), by_k.get_slice(tidx)
    do_t = transposed(s_do, NQ, R)
    delta = thr_step.make_fragment_C(thr_step.partition_shape_C((R, C)))
    _mma.wgmma(by_step, delta, _mma.accumulator_as_wgmma_a(grad, by_step, dtype),
               _mma.wgmma_operand(thr_step, s_k, "B"), False)
    for e in cutlass.range_constexpr(cute.size(delta)):
        delta[e] = delta[e] * s_sc[0, step_coords[e][1]]
    _mma.wgmma(do_p, delta, _mma.wgmma_operand(thr_do_p, do_t, "A"),
               _mma.wgmma_operand(thr_do_p, transposed(s_p, NQ, C), "B"), True)
    z = thr_step.make_fragment_C(thr_step.partition_shape_C((R, C)))
    _mma.wgmma(by_ta, z, _mma.accumulator_as_wgmma_a(delta, by_ta, dtype),
               _mma.wgmma_operand(thr_ta, transposed(s_ta, C, C), "B"), False)
    decay = s_sc[2, 0]
    for e in cutlass.range_constexpr(cute.size(grad)):
        grad[e] = grad[e] * decay
    _mma.wgmma(do_qc, grad, _mma.wgmma_operand(thr_do_qc, do_t, "A"),
               _mma.wgmma_operand(thr_do_qc, transposed(s_qc, NQ, K), "B"), True)
    _mma.wgmma(by_k, grad, _mma.accumulator_as_wgmma_a(_mma.scaled(z, -1.0), by_k, dtype),
               _mma.wgmma_operand(thr_k, transposed(s_k, C, K), "B"), True)


@cute.jit
def column_sums(acc: cute.Tensor, coords: cute.Tensor, s_red: cute.Tensor, tidx):
    """Per-column sums of an mma.sync accumulator over the rows a warp holds, in a fixed order
    (deterministic): a thread adds its rows (the (2, 2) atom's row bit and the M tiles), lanes 4
    apart (same columns) add by shuffles, and lanes 0-3 write the warp's sums to
    ``s_red[warp, column]``. Rows of ``s_red`` a warp does not write must be zero; the caller
    clears them, syncs after this, and adds the warps' rows in order."""
    warp = tidx // 32
    lane = tidx % 32
    for n in cutlass.range_constexpr(cute.size(acc, mode=[2])):
        for c in cutlass.range_constexpr(2):
            value = Float32(0.0)
            for r in cutlass.range_constexpr(2):
                for m in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                    value = value + acc[(c, r), m, n]
            for offset in cutlass.range_constexpr(2, 5):
                value = value + cute.arch.shuffle_sync_bfly(value, offset=1 << offset)
            if lane < 4:
                s_red[warp, coords[(c, 0), 0, n][1]] = value


@cute.jit
def clear_rows(s_red: cute.Tensor, tidx, threads: cutlass.Constexpr, size: cutlass.Constexpr):
    for i in cutlass.range_constexpr((size + threads - 1) // threads):
        index = tidx + i * threads
        if index < size:
            s_red[index // C, index % C] = Float32(0.0)


class ChunkReverseKernel:
    def __init__(self, config: ChunkReverseConfig):
        config.validate()
        self.dtype = cutlass_dtype(config.dtype)
        self.key_dim = config.key_dim
        self.value_dim = config.value_dim
        self.query_tile = config.query_tile
        self.warps = self.value_dim // 16
        self.threads = 32 * self.warps
        self.contained = config.contained

    @cute.jit
    def __call__(self,
                 k: cute.Tensor, v: cute.Tensor, q: cute.Tensor, do: cute.Tensor,  # as in ChunkGammaKernel; v [S_all, H, V]
                 ta: cute.Tensor, tb: cute.Tensor, p: cute.Tensor, scalars: cute.Tensor,
                 chunk_first_step: cute.Tensor, chunk_steps: cute.Tensor,  # int32 [C_max]
                 num_chunks: cute.Tensor,  # int32 [1]
                 chunk_states: cute.Tensor,  # [C_max, H, V, K] input dtype: the state at each chunk's start
                 chunk_grads: cute.Tensor,  # [C_max, H, V, K] input dtype: the state gradient at each chunk's end
                 state_bad: cute.Tensor, read_bad: cute.Tensor,  # [T_all, H] uint8 (read when contained)
                 any_flagged: cute.Tensor,  # int32 [1]: nonzero when any token is flagged (contained)
                 dv: cute.Tensor,  # [S_all, H, V] input dtype (out)
                 dq_scan: cute.Tensor,  # [T_all, H, K] float32 (out)
                 dk_scan: cute.Tensor,  # [S_all, H, K] float32 (out)
                 d_ta: cute.Tensor, d_tb: cute.Tensor,  # [C_max, H, 64, 64] float32 (out)
                 d_p: cute.Tensor,  # [C_max, H, NQ, 64] float32 (out)
                 d_scalars: cute.Tensor,  # [C_max, H, 4, 64] float32 (out): db, dc, dd
                 num_householder: Int32, stream):
        rows_mma = _mma.make_tiled_mma(self.dtype, self.warps)
        steps_mma = _mma.make_step_rows_mma(self.dtype, self.warps)
        g2s = _mma.make_g2s_copy(self.dtype, self.threads)
        # the outputs leave through a shared staging tile as 16-byte rows
        stores = dict(square=_mma.make_s2g_copy(Float32, self.threads, C),
                      values=_mma.make_s2g_copy(self.dtype, self.threads, self.value_dim))
        self.kernel(k, v, q, do, ta, tb, p, scalars, chunk_first_step, chunk_steps, num_chunks, chunk_states,
                    chunk_grads, state_bad, read_bad, any_flagged, dv, dq_scan, dk_scan, d_ta, d_tb, d_p, d_scalars,
                    num_householder,
                    rows_mma, steps_mma, g2s, stores["square"], stores["values"]).launch(
            grid=(chunk_first_step.shape[0], k.shape[1], 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, k: cute.Tensor, v: cute.Tensor, q: cute.Tensor, do: cute.Tensor, ta: cute.Tensor,
               tb: cute.Tensor, p: cute.Tensor, scalars: cute.Tensor, chunk_first_step: cute.Tensor,
               chunk_steps: cute.Tensor, num_chunks: cute.Tensor, chunk_states: cute.Tensor,
               chunk_grads: cute.Tensor, state_bad: cute.Tensor, read_bad: cute.Tensor, any_flagged: cute.Tensor,
               dv: cute.Tensor,
               dq_scan: cute.Tensor, dk_scan: cute.Tensor,
               d_ta: cute.Tensor, d_tb: cute.Tensor, d_p: cute.Tensor, d_scalars: cute.Tensor,
               num_householder: Int32, rows_mma: cute.TiledMma, steps_mma: cute.TiledMma, g2s: cute.TiledCopy,
               s2g_square: cute.TiledCopy, s2g_values: cute.TiledCopy):
        K, V, NQ, NH = self.key_dim, self.value_dim, self.query_tile, num_householder
        tidx, _, _ = cute.arch.thread_idx()
        chunk, head, _ = cute.arch.block_idx()
        allocator = cutlass.utils.SmemAllocator()
        tile = lambda rows, cols: allocator.allocate_tensor(self.dtype, _mma.smem_tile_layout(rows, cols), 128)  # noqa: E731
        s_k, s_v, s_q, s_do = tile(C, K), tile(C, V), tile(NQ, K), tile(NQ, V)
        s_ta, s_tb, s_p, s_x, s_dx = tile(C, C), tile(C, C), tile(NQ, C), tile(V, K), tile(V, K)
        s_dd, s_d, s_z = tile(V, C), tile(V, C), tile(V, C)
        s_sc = allocator.allocate_tensor(Float32, cute.make_layout((4, C), stride=(C, 1)), 16)
        s_red = allocator.allocate_tensor(Float32, cute.make_layout((self.warps, C), stride=(C, 1)), 16)
        # one output at a time on its way to global memory: [64, 64] float32 (or 64 rows x V of dv), rows
        # padded by 16 bytes; [., K] float32 outputs pass in 64-column halves (all of it fits at NQ = 64)
        s_stage = allocator.allocate_tensor(Float32, cute.make_layout(C * (C + 4)), 16)

        if chunk < num_chunks[0]:
            step_coords = rows_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((V, C)))
            first, steps = chunk_first_step[chunk], chunk_steps[chunk]
            self.load(g2s, tidx, chunk, head, k, v, q, do, ta, tb, p, scalars, chunk_states, chunk_grads, first, steps,
                      s_k, s_v, s_q, s_do, s_ta, s_tb, s_p, s_x, s_dx, s_sc, NH,
                      chunk_common.contained_flags(self, state_bad, read_bad, any_flagged))
            self.values_phase(rows_mma, tidx, step_coords, s_sc, s_k, s_v, s_do, s_ta, s_tb, s_p, s_x, s_dx, s_dd,
                              s_d, s_z, s_red, s_stage, s2g_values, dv, d_scalars, chunk, head, first, steps)
            cute.arch.sync_threads()
            self.steps_phase(steps_mma, tidx, s_sc, s_k, s_v, s_q, s_do, s_x, s_dd, s_d, s_z, s_dx, s_red, s_stage,
                             s2g_square, dq_scan, dk_scan, d_ta, d_tb, d_p, d_scalars, chunk, head, first,
                             steps, NH)

    @cute.jit
    def load(self, g2s, tidx, chunk, head, k, v, q, do, ta, tb, p, scalars, chunk_states, chunk_grads, first, steps,
             s_k, s_v, s_q, s_do, s_ta, s_tb, s_p, s_x, s_dx, s_sc, num_householder, token_flags=None):
        """Load the chunk's tiles, its start state and end gradient, and wait for them; contained (token flags
        given), zero the k and v rows of state_bad tokens and the q and dO rows of read_bad ones (a poisoned
        output passes no gradient)."""
        K, V, NQ = self.key_dim, self.value_dim, self.query_tile
        first_token = first // num_householder
        tokens = steps // num_householder
        _mma.copy_rows_g2s(g2s, tidx, cute.local_tile(cute.domain_offset((first, 0), k[None, head, None]), (C, K),
                                                      (0, 0)), s_k, steps)
        _mma.copy_rows_g2s(g2s, tidx, cute.local_tile(cute.domain_offset((first, 0), v[None, head, None]), (C, V),
                                                      (0, 0)), s_v, steps)
        _mma.copy_rows_g2s(g2s, tidx, ta[chunk, head, None, None], s_ta, C)
        _mma.copy_rows_g2s(g2s, tidx, tb[chunk, head, None, None], s_tb, C)
        _mma.copy_rows_g2s(g2s, tidx, chunk_states[chunk, head, None, None], s_x, V)
        _mma.copy_rows_g2s(g2s, tidx, chunk_grads[chunk, head, None, None], s_dx, V)
        _mma.copy_rows_g2s(g2s, tidx, cute.local_tile(cute.domain_offset((first_token, 0), q[None, head, None]),
                                                      (NQ, K), (0, 0)), s_q, tokens)
        _mma.copy_rows_g2s(g2s, tidx, cute.local_tile(cute.domain_offset((first_token, 0), do[None, head, None]),
                                                      (NQ, V), (0, 0)), s_do, tokens)
        _mma.copy_rows_g2s(g2s, tidx, p[chunk, head, None, None], s_p, NQ)
        cute.arch.cp_async_commit_group()
        for i in cutlass.range_constexpr(4 * C // self.threads):
            index = tidx + i * self.threads
            s_sc[index // C, index % C] = scalars[chunk, head, index // C, index % C]
        cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(token_flags is not None):
            chunk_common.zero_flagged_chunk_rows(g2s, tidx, token_flags, head, first_token, steps, num_householder, K,
                                                 NQ, s_k, s_v, s_q, s_do)
        cute.arch.sync_threads()

    @cute.jit
    def values_phase(self, rows_mma, tidx, step_coords, s_sc, s_k, s_v, s_do, s_ta, s_tb, s_p, s_x, s_dx, s_dd,
                     s_d, s_z, s_red, s_stage, s2g_values, dv, d_scalars, chunk, head, first, steps):
        """Rows = value rows: D (recomputed), dD, dv, Z, the reductions db and dd, and the staging of
        D, dD and Z for the step-row products."""
        K, V, NQ, dtype = self.key_dim, self.value_dim, self.query_tile, self.dtype
        thr = rows_mma.get_slice(tidx)
        x_a = _mma.SmemOperand(rows_mma, tidx, s_x, dtype, operand="A", transpose=False)
        y = cute.make_rmem_tensor(thr.partition_shape_C((V, C)), Float32)
        y.fill(0.0)
        _mma.gemm_smem_ab(rows_mma, y, x_a, _b_operand(rows_mma, tidx, s_k, dtype, False))
        d_acc = cute.make_rmem_tensor(thr.partition_shape_C((V, C)), Float32)
        d_acc.fill(0.0)
        v_t = _mma.SmemOperand(rows_mma, tidx, _mma.transposed_view(s_v, C, V), dtype, operand="A", transpose=True)
        _mma.gemm_smem_ab(rows_mma, d_acc, v_t, _b_operand(rows_mma, tidx, s_tb, dtype, False))
        _mma.gemm_smem_b(rows_mma, d_acc, _scaled_as_a(y, lambda e: Float32(-1.0), dtype),
                         _b_operand(rows_mma, tidx, s_ta, dtype, False))
        # M1 = dX k^T; db = colsum(D * M1) (into y's registers: Y is consumed)
        m1 = cute.make_rmem_tensor(thr.partition_shape_C((V, C)), Float32)
        m1.fill(0.0)
        dx_a = _mma.SmemOperand(rows_mma, tidx, s_dx, dtype, operand="A", transpose=False)
        _mma.gemm_smem_ab(rows_mma, m1, dx_a, _b_operand(rows_mma, tidx, s_k, dtype, False))
        for e in cutlass.range_constexpr(cute.size(m1)):
            y[e] = d_acc[e] * m1[e]
            m1[e] = m1[e] * s_sc[0, step_coords[e][1]]
        column_sums(y, step_coords, s_red, tidx)  # every warp holds every column: no clearing
        _mma.stage_accumulator(d_acc, step_coords, s_d)
        # dD = M1 diag(b) + dO^T P, staged, then dv^T = dD Tb (written transposed) and Z = dD Ta
        do_t = _mma.SmemOperand(rows_mma, tidx, _mma.transposed_view(s_do, NQ, V), dtype, operand="A", transpose=True)
        _mma.gemm_smem_ab(rows_mma, m1, do_t, _b_operand(rows_mma, tidx, _mma.transposed_view(s_p, NQ, C), dtype, True))
        _mma.stage_accumulator(m1, step_coords, s_dd)
        dd_a = _mma.accumulator_as_a(m1, dtype)
        dv_t = cute.make_rmem_tensor(thr.partition_shape_C((V, C)), Float32)
        dv_t.fill(0.0)
        _mma.gemm_smem_b(rows_mma, dv_t, dd_a, _b_operand(rows_mma, tidx, _mma.transposed_view(s_tb, C, C), dtype, True))
        _mma.stage_accumulator(dv_t, step_coords, _mma.staging_view(s_stage, dtype, C, V, transpose=True))
        z = cute.make_rmem_tensor(thr.partition_shape_C((V, C)), Float32)
        z.fill(0.0)
        _mma.gemm_smem_b(rows_mma, z, dd_a, _b_operand(rows_mma, tidx, _mma.transposed_view(s_ta, C, C), dtype, True))
        _mma.stage_accumulator(z, step_coords, s_z)
        # dd = sum(X * dX) over the stored (rounded) tiles, each thread a strided share
        partial = Float32(0.0)
        for i in cutlass.range_constexpr(V * K // self.threads):
            index = tidx + i * self.threads
            partial = partial + s_x[index // K, index % K].to(Float32) * s_dx[index // K, index % K].to(Float32)
        partial = cute.arch.warp_reduction_sum(partial)
        cute.arch.sync_threads()  # db partials in s_red and the staged dv are complete
        g_dv = cute.local_tile(cute.domain_offset((first, 0), dv[None, head, None]), (C, V), (0, 0))
        _mma.copy_rows_s2g(s2g_values, tidx, _mma.staging_view(s_stage, dtype, C, V), g_dv, steps)
        if tidx < C:
            total = Float32(0.0)
            for w in cutlass.range_constexpr(self.warps):
                total = total + s_red[w, tidx]
            d_scalars[chunk, head, 0, tidx] = total
        cute.arch.sync_threads()
        if tidx % 32 == 0:
            s_red[tidx // 32, 0] = partial
        cute.arch.sync_threads()
        if tidx == 0:
            total = Float32(0.0)
            for w in cutlass.range_constexpr(self.warps):
                total = total + s_red[w, 0]
            d_scalars[chunk, head, 2, 0] = total

    @cute.jit
    def steps_phase(self, steps_mma, tidx, s_sc, s_k, s_v, s_q, s_do, s_x, s_dd, s_d, s_z, s_dx, s_red, s_stage,
                    s2g_square, dq_scan, dk_scan, d_ta, d_tb, d_p, d_scalars, chunk, head, first, steps,
                    num_householder):
        """Rows = steps (or keys): dTb, dTa, dP, the scan's dk, and R = X^T dO^T for dq and dc. Each
        output is staged in ``s_stage``, then stored as 16-byte rows (a sync on either side)."""
        K, V, NQ, dtype = self.key_dim, self.value_dim, self.query_tile, self.dtype
        thr = steps_mma.get_slice(tidx)
        staged_square = _mma.staging_view(s_stage, Float32, C, C)

        def a_transposed(tile, rows, cols):  # A operand [cols, rows] read from a [rows, cols] tile
            return _mma.SmemOperand(steps_mma, tidx, _mma.transposed_view(tile, rows, cols), dtype, operand="A",
                                    transpose=True)

        square = thr.partition_C(cute.make_identity_tensor((C, C)))
        # dTb = dD^T v^T
        acc = cute.make_rmem_tensor(thr.partition_shape_C((C, C)), Float32)
        acc.fill(0.0)
        _mma.gemm_smem_ab(steps_mma, acc, a_transposed(s_dd, V, C), _b_operand(steps_mma, tidx, s_v, dtype, False))
        _mma.stage_accumulator(acc, square, staged_square)
        cute.arch.sync_threads()
        _mma.copy_tile_s2g(s2g_square, tidx, staged_square, d_tb[chunk, head, None, None])
        # dTa = -(dD^T X) k^T
        by_key = thr.partition_C(cute.make_identity_tensor((C, K)))
        w = cute.make_rmem_tensor(thr.partition_shape_C((C, K)), Float32)
        w.fill(0.0)
        _mma.gemm_smem_ab(steps_mma, w, a_transposed(s_dd, V, C),
                          _b_operand(steps_mma, tidx, _mma.transposed_view(s_x, V, K), dtype, True))
        acc.fill(0.0)
        if cutlass.const_expr(self.warps > 4):
            # warps split N here, so a warp's accumulator holds only part of each row of w and cannot be
            # the A operand: stage -w through shared memory, in dD's tile (dD is not read again this chunk;
            # V = 128 here, so its V x 64 tile holds 64 x K)
            s_w = cute.make_tensor(s_dd.iterator, _mma.smem_tile_layout(C, K))
            cute.arch.sync_threads()
            for e in cutlass.range_constexpr(cute.size(w)):
                j, c = by_key[e]
                s_w[j, c] = (-w[e]).to(dtype)
            cute.arch.sync_threads()
            _mma.gemm_smem_ab(steps_mma, acc, _mma.SmemOperand(steps_mma, tidx, s_w, dtype, operand="A",
                                                               transpose=False),
                              _b_operand(steps_mma, tidx, s_k, dtype, False))
        else:
            _mma.gemm_smem_b(steps_mma, acc, _scaled_as_a(w, lambda e: Float32(-1.0), dtype),
                             _b_operand(steps_mma, tidx, s_k, dtype, False))
        cute.arch.sync_threads()  # dTb has left the staging tile
        _mma.stage_accumulator(acc, square, staged_square)
        cute.arch.sync_threads()
        _mma.copy_tile_s2g(s2g_square, tidx, staged_square, d_ta[chunk, head, None, None])
        # dP^T = D^T dO^T, written transposed
        by_token = thr.partition_C(cute.make_identity_tensor((C, NQ)))
        dp_t = cute.make_rmem_tensor(thr.partition_shape_C((C, NQ)), Float32)
        dp_t.fill(0.0)
        _mma.gemm_smem_ab(steps_mma, dp_t, a_transposed(s_d, V, C), _b_operand(steps_mma, tidx, s_do, dtype, False))
        cute.arch.sync_threads()  # dTa has left the staging tile
        _mma.stage_accumulator(dp_t, by_token, _mma.staging_view(s_stage, Float32, NQ, C, transpose=True))
        cute.arch.sync_threads()
        _mma.copy_tile_s2g(s2g_square, tidx, _mma.staging_view(s_stage, Float32, NQ, C), d_p[chunk, head, None, None])
        # dk (scan part) = diag(b) D^T grad' - Z^T X
        dk_plus = cute.make_rmem_tensor(thr.partition_shape_C((C, K)), Float32)
        dk_plus.fill(0.0)
        _mma.gemm_smem_ab(steps_mma, dk_plus, a_transposed(s_d, V, C),
                          _b_operand(steps_mma, tidx, _mma.transposed_view(s_dx, V, K), dtype, True))
        w.fill(0.0)
        _mma.gemm_smem_ab(steps_mma, w, a_transposed(s_z, V, C),
                          _b_operand(steps_mma, tidx, _mma.transposed_view(s_x, V, K), dtype, True))
        for e in cutlass.range_constexpr(cute.size(w)):
            dk_plus[e] = dk_plus[e] * s_sc[0, by_key[e][0]] - w[e]
        g_dk = cute.local_tile(cute.domain_offset((first, 0), dk_scan[None, head, None]), (C, K), (0, 0))
        for half in cutlass.range_constexpr(K // C):
            cute.arch.sync_threads()  # the previous output has left the staging tile
            _mma.stage_accumulator(dk_plus, by_key, staged_square, None, None, half * C)
            cute.arch.sync_threads()
            _mma.copy_rows_s2g(s2g_square, tidx, staged_square, cute.local_tile(g_dk, (C, C), (0, half)), steps)
        # R^T = X^T dO^T [K, NQ]: dq (scan part) = c_t R[t, :], dc_t = R[t, :] . q_t
        key_token = thr.partition_C(cute.make_identity_tensor((K, NQ)))
        r_t = cute.make_rmem_tensor(thr.partition_shape_C((K, NQ)), Float32)
        r_t.fill(0.0)
        _mma.gemm_smem_ab(steps_mma, r_t, a_transposed(s_x, V, K), _b_operand(steps_mma, tidx, s_do, dtype, False))
        first_token = first // num_householder
        tokens = steps // num_householder
        partial = cute.make_fragment_like(r_t, Float32)
        for e in cutlass.range_constexpr(cute.size(r_t)):
            c, t = key_token[e]
            partial[e] = r_t[e] * s_q[t, c].to(Float32)
        clear_rows(s_red, tidx, self.threads, self.warps * C)  # warps split the columns here
        cute.arch.sync_threads()
        column_sums(partial, key_token, s_red, tidx)
        # dq rows (tokens) from R^T's columns, by 64 keys at a time
        g_dq = cute.local_tile(cute.domain_offset((first_token, 0), dq_scan[None, head, None]), (NQ, K), (0, 0))
        staged_dq = _mma.staging_view(s_stage, Float32, NQ, C)
        for half in cutlass.range_constexpr(K // C):
            cute.arch.sync_threads()  # dk (or the previous half) has left the staging tile
            _mma.stage_accumulator(r_t, key_token, _mma.staging_view(s_stage, Float32, NQ, C, transpose=True),
                                   s_sc[1, None], half * C)
            cute.arch.sync_threads()
            _mma.copy_rows_s2g(s2g_square, tidx, staged_dq, cute.local_tile(g_dq, (NQ, C), (0, half)), tokens)
        cute.arch.sync_threads()
        if tidx < NQ:
            total = Float32(0.0)
            for w_index in cutlass.range_constexpr(self.warps):
                total = total + s_red[w_index, tidx]
            d_scalars[chunk, head, 1, tidx] = total
