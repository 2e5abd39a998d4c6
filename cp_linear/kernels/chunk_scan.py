"""The chunk-to-chunk scan of a segment on tensor cores, with the state in registers.

One CTA per (segment, head, row block). The state is held transposed, X = S^T, as a float32
tensor-core accumulator [R, K] (R = 128 or 64 rows); warp w owns rows [16 w, 16 w + 16), so every
product whose rows are state rows needs no other warp's data. Two instruction families
(``ChunkScanConfig.mma``): "sync" runs warp-level ``mma.sync`` m16n8k16 with B operands loaded by
every warp through ``ldmatrix``; "wgmma" runs Hopper warpgroup MMAs (m64nNk16, A from
registers, B read by the tensor cores straight from shared memory, once per warpgroup of 4 warps
instead of once per warp). Per chunk (``emulation.py`` gives the algebra; ``chunk_prep`` made Ta, Tb, P and the
scalars), with rounding to the input dtype wherever a value becomes an MMA operand:

    Y  = X k^T                                  A: X from registers, B: k (K-major)
    D  = v^T Tb^T - Y Ta^T                      (delta^T; value rows only for the first term)
    O  = (X q^T) diag(c) + D P^T                (modes "output", "output_states" only)
    X <- exp(G_last) X + (D diag(b)) k          B: k^T (the same k tile, read MN-major)

Four modes (compile-time):
* "summary": rows are the segment's [E^T ; M^T] (V value rows, then K transition rows that see
  zero values), starting from [0 ; I]; the end rows go to ``summary`` [S, H, V + K, K]. Only
  segments whose flag has bit 0 set run; a row block of transition rows only, in a segment flagged
  ``VALUES_ONLY_FLAG``, writes zeros and scans nothing (its sequence starts from zero rows there).
  With ``clear_unsummarised`` the other segments' rows (and those of unused slots) are written as
  zeros: the kernel backward keeps ``summary`` in its saved buffer, whose every row is defined.
* "output": rows are S^T from ``state_in`` [S, H, V, K] (the folded incoming state of each
  segment); outputs go to ``o``. A sequence's last segment writes its end state, the sequence's
  final state, to ``state_out`` [N, H, K, V] (S, not S^T: the layout the frontends return), so no
  per-segment end state makes a round trip through HBM; the CTA finds its sequence in
  ``seq_first_segment`` while its first chunk's loads are in flight.
* "states": rows as in "output", no outputs: every chunk's start state goes to ``chunk_states``
  ([C_max, H, V·K], input dtype), the chunk states the backward reads (its recompute of the forward).
* "output_states": "output" and "states" in one pass (a training forward that keeps the chunk
  states, so that the backward does not rerun the scan). The start state of chunk i + 1 is staged
  after chunk i's step, in that chunk's k tile (free by then) when the CTA has 64 rows: a staging
  tile of its own would take the shared memory that lets two 64-row CTAs share an SM.

The next chunk's tiles are fetched with cp.async into the other of two shared-memory stages
while the current chunk is computed. A chunk's outputs are staged token-major in its q tile (read
by then) and leave as 16-byte runs of each token's rows (``store_outputs``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cp_linear.kernels import _chunk_common as chunk_common
from cp_linear.kernels import _mma
from cp_linear.kernels._common import cutlass_dtype
from cp_linear.kernels.configs import CHUNK_SIZE, SUMMARY_FLAG, VALUES_ONLY_FLAG, ChunkScanConfig

C = CHUNK_SIZE
STAGES = 2


def _scaled_as_a(acc: cute.Tensor, scale_of, dtype) -> cute.Tensor:
    """``accumulator_as_a`` of acc * scale_of(element index) (a per-element float32 factor)."""
    scaled = cute.make_fragment_like(acc, Float32)
    for e in range(cute.size(acc)):  # trace-time loop (plain helper, not a jit function)
        scaled[e] = acc[e] * scale_of(e)
    return _mma.accumulator_as_a(scaled, dtype)


class ChunkScanKernel:
    def __init__(self, config: ChunkScanConfig):
        config.validate()
        self.dtype = cutlass_dtype(config.dtype)
        self.key_dim = config.key_dim
        self.value_dim = config.value_dim
        self.query_tile = config.query_tile
        self.rows = config.rows_per_cta
        self.warps = self.rows // 16
        self.threads = 32 * self.warps
        self.summary = config.mode == "summary"
        self.states = config.mode == "states"  # chunk states staged before each step (own staging tile)
        self.output_states = config.mode == "output_states"  # chunk states staged after each step
        self.reads_queries = config.mode in ("output", "output_states")
        self.wgmma = config.mma == "wgmma"
        self.contained = config.contained

    def row_blocks(self) -> int:
        stacked = self.value_dim + (self.key_dim if self.summary else 0)
        return stacked // self.rows

    @cute.jit
    def __call__(self,
                 k: cute.Tensor,  # [S_all, H, K] input dtype
                 v: cute.Tensor,  # [S_all, H, V] input dtype
                 q: cute.Tensor,  # [T_all, H, K] input dtype (read in the output modes)
                 ta: cute.Tensor,  # [C_max, H, 64, 64] input dtype
                 tb: cute.Tensor,  # [C_max, H, 64, 64] input dtype
                 p: cute.Tensor,  # [C_max, H, NQ, 64] input dtype (read in the output modes)
                 scalars: cute.Tensor,  # [C_max, H, 4, 64] float32
                 chunk_first_step: cute.Tensor,  # int32 [C_max]
                 chunk_steps: cute.Tensor,  # int32 [C_max]
                 seg_first_chunk: cute.Tensor,  # int32 [S_max]
                 seg_chunks: cute.Tensor,  # int32 [S_max]
                 seg_order: cute.Tensor,  # int32 [S_max]: the segment of each grid slot
                 seg_flags: cute.Tensor,  # int32 [S_max] (bit 0: build this segment's summary)
                 num_segments: cute.Tensor,  # int32 [1]
                 seq_first_segment: cute.Tensor,  # int32 [N + 1] (read by the output modes)
                 state_in: cute.Tensor,  # [S_max, H, V, K] float32 (modes other than "summary")
                 state_bad: cute.Tensor,  # [T_all, H] uint8 (read when contained)
                 read_bad: cute.Tensor,  # [T_all, H] uint8 (read when contained, in the output modes)
                 any_flagged: cute.Tensor,  # int32 [1]: nonzero when any token is flagged (contained)
                 state_out: cute.Tensor,  # [N, H, K, V] float32 (out, the output modes: final states) or
                                          # [S_max, H, V + K, K] (out, mode "summary")
                 o: cute.Tensor,  # [T_all, H, V] input dtype (out, modes "output", "output_states")
                 chunk_states: cute.Tensor,  # [C_max, H, V K] input dtype (out, modes "states", "output_states")
                 num_householder: Int32,
                 clear_unsummarised: Int32,  # mode "summary": 1 writes zero rows for the segments not summarised
                 stream):
        tiled_mma = _mma.make_tiled_mma(self.dtype, self.warps)  # the "sync" products (unused for "wgmma")
        g2s = _mma.make_g2s_copy(self.dtype, self.threads)
        s2g = _mma.make_s2g_copy(self.dtype, self.threads)  # the chunk states only
        self.kernel(k, v, q, ta, tb, p, scalars, chunk_first_step, chunk_steps, seg_first_chunk, seg_chunks,
                    seg_order, seg_flags, num_segments, seq_first_segment, state_in, state_bad, read_bad, any_flagged,
                    state_out,
                    o, chunk_states, num_householder, clear_unsummarised, tiled_mma, g2s, s2g).launch(
            grid=(k.shape[1], seg_first_chunk.shape[0], self.row_blocks()), block=(self.threads, 1, 1),
            stream=stream)

    @cute.jit
    def load_chunk(self, g2s, tidx, chunk, head, value_col, is_value_rows, k, v, q, ta, tb, p,
                   chunk_first_step, chunk_steps, s_k, s_v, s_ta, s_tb, s_q, s_p, num_householder):
        """Issue the cp.async copies of one chunk's tiles into one stage (rows past the chunk are zero)."""
        K, R, NQ = self.key_dim, self.rows, self.query_tile
        first = chunk_first_step[chunk]
        steps = chunk_steps[chunk]
        _mma.copy_rows_g2s(g2s, tidx, cute.local_tile(cute.domain_offset((first, 0), k[None, head, None]), (C, K),
                                                      (0, 0)), s_k, steps)
        if is_value_rows:
            g_v = cute.local_tile(cute.domain_offset((first, value_col), v[None, head, None]), (C, R), (0, 0))
            _mma.copy_rows_g2s(g2s, tidx, g_v, s_v, steps)
        _mma.copy_rows_g2s(g2s, tidx, ta[chunk, head, None, None], s_ta, C)
        _mma.copy_rows_g2s(g2s, tidx, tb[chunk, head, None, None], s_tb, C)
        if cutlass.const_expr(self.reads_queries):
            first_token = first // num_householder
            tokens = steps // num_householder
            g_q = cute.local_tile(cute.domain_offset((first_token, 0), q[None, head, None]), (NQ, K), (0, 0))
            _mma.copy_rows_g2s(g2s, tidx, g_q, s_q, tokens)
            _mma.copy_rows_g2s(g2s, tidx, p[chunk, head, None, None], s_p, NQ)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def clean_chunk(self, g2s, tidx, chunk, head, chunk_first_step, chunk_steps, s_k, s_v, s_q, s_read_bad,
                    num_householder, token_flags):
        """Contained (after the copies' wait, before the barrier): zero the k and v rows of state_bad tokens and
        the q rows of read_bad tokens that this thread copied (``chunk_common.zero_flagged_chunk_rows``); the
        output modes also publish the q rows' flags in ``s_read_bad`` (this stage's [NQ]) for the NaN stores.
        The value tile of transition rows is never loaded: its zero rows stay zero."""
        if cutlass.const_expr(self.contained):
            first_token = chunk_first_step[chunk] // num_householder
            if cutlass.const_expr(self.reads_queries):
                chunk_common.zero_flagged_chunk_rows(g2s, tidx, token_flags, head, first_token, chunk_steps[chunk],
                                                     num_householder, self.key_dim, self.query_tile, s_k, s_v, s_q,
                                                     s_read_bad=s_read_bad)
            else:  # no q tile (s_q is an alias of another tile here)
                chunk_common.zero_flagged_chunk_rows(g2s, tidx, token_flags, head, first_token, chunk_steps[chunk],
                                                     num_householder, self.key_dim, self.query_tile, s_k, s_v)

    def _tile(self, allocator, rows: int, cols: int) -> cute.Tensor:
        return staged_tile(allocator, self.dtype, rows, cols, self.wgmma)

    @cute.kernel
    def kernel(self, k: cute.Tensor, v: cute.Tensor, q: cute.Tensor, ta: cute.Tensor, tb: cute.Tensor,
               p: cute.Tensor, scalars: cute.Tensor, chunk_first_step: cute.Tensor, chunk_steps: cute.Tensor,
               seg_first_chunk: cute.Tensor, seg_chunks: cute.Tensor, seg_order: cute.Tensor, seg_flags: cute.Tensor,
               num_segments: cute.Tensor, seq_first_segment: cute.Tensor, state_in: cute.Tensor,
               state_bad: cute.Tensor, read_bad: cute.Tensor, any_flagged: cute.Tensor, state_out: cute.Tensor,
               o: cute.Tensor,
               chunk_states: cute.Tensor, num_householder: Int32, clear_unsummarised: Int32, tiled_mma: cute.TiledMma,
               g2s: cute.TiledCopy, s2g: cute.TiledCopy):
        K, V, R, NQ, NH = self.key_dim, self.value_dim, self.rows, self.query_tile, num_householder
        tidx, _, _ = cute.arch.thread_idx()
        head, slot, row_block = cute.arch.block_idx()  # heads fastest: CTAs start in slot order
        segment = seg_order[slot]  # longest segments first (forward_layout's seg_order)
        allocator = cutlass.utils.SmemAllocator()
        s_k_all = self._tile(allocator, C, K)
        s_v_all = self._tile(allocator, C, R)
        s_ta_all = self._tile(allocator, C, C)
        s_tb_all = self._tile(allocator, C, C)
        s_q_all = s_k_all
        s_p_all = s_ta_all
        if cutlass.const_expr(self.reads_queries):
            s_q_all = self._tile(allocator, NQ, K)
            s_p_all = self._tile(allocator, NQ, C)
        s_scalars = allocator.allocate_tensor(Float32, cute.make_layout((4, C, STAGES), stride=(C, 1, 4 * C)), 16)
        s_out = None  # a chunk's start state on its way to chunk_states, as whole 16-byte rows
        if cutlass.const_expr(self.states or (self.output_states and R != C)):
            s_out = allocator.allocate_tensor(self.dtype, _mma.smem_tile_layout(R, K), 128)
        s_sequence = None  # the output modes: the sequence whose last segment this CTA runs, or -1
        if cutlass.const_expr(self.reads_queries):
            s_sequence = allocator.allocate_tensor(Int32, cute.make_layout((1,)), 16)
        s_read_bad_all = None  # contained output modes: each stage's token flags, for the NaN stores
        if cutlass.const_expr(self.contained and self.reads_queries):
            s_read_bad_all = allocator.allocate_tensor(cutlass.Uint8, cute.make_layout((NQ, STAGES)), 16)

        run = segment < num_segments[0]
        if cutlass.const_expr(self.summary):
            flags = seg_flags[cutlass.min(segment, seg_flags.shape[0] - 1)]
            # with clear_unsummarised the segments not summarised (and the unused slots) get zero rows: the
            # summaries then are the kernel backward's saved rows, deterministic as every saved output
            cleared = (clear_unsummarised != 0) & (((flags & SUMMARY_FLAG) == 0) | (segment >= num_segments[0]))
            run = run & ((flags & SUMMARY_FLAG) != 0)
            # transition rows nobody reads (VALUES_ONLY_FLAG): zeros, so the fold's X M^T stays finite
            unneeded = run & ((flags & VALUES_ONLY_FLAG) != 0) & (row_block * R >= V)
            if unneeded | cleared:
                for i in cutlass.range(R * K // self.threads, unroll=8):
                    flat = i * self.threads + tidx
                    state_out[segment, head, row_block * R + flat // K, flat % K] = Float32(0.0)
            run = run & (((flags & VALUES_ONLY_FLAG) == 0) | (row_block * R < V))
        if run:
            row0 = row_block * R
            is_value_rows = row0 < V
            value_col = cute.assume(cutlass.min(row0, V - R), divby=64)  # keeps 16-byte alignment known
            first_chunk = seg_first_chunk[segment]
            chunk_count = seg_chunks[segment]

            if cutlass.const_expr(self.wgmma):
                products = _WgmmaProducts(self, tidx, s_k_all, s_v_all, s_ta_all, s_tb_all, s_q_all, s_p_all)
            else:
                products = _SyncProducts(self, tidx, tiled_mma)
            state = products.state_accumulator()
            state_coords = products.coordinates(state, (R, K))
            state_mma = products.state_mma  # the state's C layout, for its stmatrix staging
            for e in cutlass.range_constexpr(cute.size(state)):
                r, c = state_coords[e]
                if cutlass.const_expr(self.summary):
                    state[e] = Float32(0.0)
                    if (row0 + r - V) == c:
                        state[e] = Float32(1.0)
                else:
                    state[e] = state_in[segment, head, row0 + r, c]

            if not is_value_rows:  # transition rows: a zero value tile in both stages, never loaded
                elements = C * R * STAGES
                flat = cute.make_tensor(s_v_all.iterator, cute.make_layout(elements))
                for i in cutlass.range(elements // self.threads, unroll=8):
                    flat[tidx + i * self.threads] = self.dtype(0.0)
            token_flags = chunk_common.contained_flags(self, state_bad, read_bad, any_flagged)
            flagged = False  # contained: the launch has a flagged token (the NaN stores read their rows' flags)
            if cutlass.const_expr(token_flags is not None):
                flagged = token_flags[2]
            self.load_chunk(g2s, tidx, first_chunk, head, value_col, is_value_rows, k, v, q, ta, tb, p,
                            chunk_first_step, chunk_steps, s_k_all[None, None, 0], s_v_all[None, None, 0],
                            s_ta_all[None, None, 0], s_tb_all[None, None, 0], s_q_all[None, None, 0],
                            s_p_all[None, None, 0], NH)
            if cutlass.const_expr(self.reads_queries):
                self.find_final_sequence(tidx, seq_first_segment, segment, s_sequence)
            # the chunk's 4 x 64 float32 scalars travel through registers, one chunk ahead
            per_thread = 4 * C // self.threads
            scalar_next = cute.make_rmem_tensor(cute.make_layout((per_thread,)), Float32)
            for j in cutlass.range_constexpr(per_thread):
                index = tidx + j * self.threads
                scalar_next[j] = scalars[first_chunk, head, index // C, index % C]
            if cutlass.const_expr(self.output_states):  # chunk 0's start state, staged in stage 1 (loaded later)
                if chunk_count > 0:
                    self.store_chunk_state(s2g, tidx, state_mma, state, state_coords, s_out, s_k_all, 1,
                                           chunk_states, first_chunk, head, row_block)
            for it in range(chunk_count):
                stage = it % STAGES
                chunk = first_chunk + it
                for j in cutlass.range_constexpr(per_thread):
                    index = tidx + j * self.threads
                    s_scalars[index // C, index % C, stage] = scalar_next[j]
                if cutlass.const_expr(self.states):
                    _mma.stage_accumulator_stmatrix(state_mma, tidx, state, s_out)
                cute.arch.cp_async_wait_group(0)
                s_read_bad = None
                if cutlass.const_expr(s_read_bad_all is not None):
                    s_read_bad = s_read_bad_all[None, stage]
                self.clean_chunk(g2s, tidx, chunk, head, chunk_first_step, chunk_steps, s_k_all[None, None, stage],
                                 s_v_all[None, None, stage], s_q_all[None, None, stage], s_read_bad, NH, token_flags)
                if cutlass.const_expr(self.wgmma):
                    cute.arch.fence_view_async_shared()  # cp.async/st.shared data -> the async proxy of wgmma
                cute.arch.sync_threads()
                if it + 1 < chunk_count:
                    other = 1 - stage
                    self.load_chunk(g2s, tidx, chunk + 1, head, value_col, is_value_rows, k, v, q, ta, tb, p,
                                    chunk_first_step, chunk_steps, s_k_all[None, None, other],
                                    s_v_all[None, None, other], s_ta_all[None, None, other],
                                    s_tb_all[None, None, other], s_q_all[None, None, other],
                                    s_p_all[None, None, other], NH)
                    for j in cutlass.range_constexpr(per_thread):
                        index = tidx + j * self.threads
                        scalar_next[j] = scalars[chunk + 1, head, index // C, index % C]
                s_sc = s_scalars[None, None, stage]
                first_token = chunk_first_step[chunk] // NH
                tokens = chunk_steps[chunk] // NH
                if cutlass.const_expr(self.states):  # staged before the sync above; stored by whole rows
                    _mma.copy_tile_s2g(s2g, tidx, s_out, self.chunk_state_rows(chunk_states, chunk, head, row_block))
                self.chunk_step(products, state, stage, s_sc, s_k_all, s_v_all, s_ta_all, s_tb_all,
                                s_q_all, s_p_all, o, head, row0, first_token, tokens, s_read_bad, flagged)
                if cutlass.const_expr(self.states):
                    cute.arch.sync_threads()  # every row of s_out is stored before the next chunk restages it
                if cutlass.const_expr(self.output_states):
                    if it + 1 < chunk_count:
                        cute.arch.sync_threads()  # every warp is done with this stage's tiles
                        self.store_chunk_state(s2g, tidx, state_mma, state, state_coords, s_out, s_k_all, stage,
                                               chunk_states, chunk + 1, head, row_block)
                        # the next loads into this stage are issued after the next iteration's sync

            if cutlass.const_expr(self.summary):
                for e in cutlass.range_constexpr(cute.size(state)):
                    r, c = state_coords[e]
                    state_out[segment, head, row0 + r, c] = state[e]
            if cutlass.const_expr(self.reads_queries):
                cute.arch.sync_threads()  # s_sequence is written (the chunk loop's barriers order it too)
                final_sequence = s_sequence[0]
                if final_sequence >= 0:
                    # S = X^T: lanes 4 apart hold consecutive rows of X, so each store covers whole sectors
                    for e in cutlass.range_constexpr(cute.size(state)):
                        r, c = state_coords[e]
                        state_out[final_sequence, head, c, row0 + r] = state[e]

    @cute.jit
    def find_final_sequence(self, tidx, seq_first_segment: cute.Tensor, segment, s_sequence: cute.Tensor):
        """``s_sequence[0]`` = n when ``segment`` is the last segment of sequence n, else -1. Exactly one n
        has seq_first_segment[n] <= segment == seq_first_segment[n + 1] - 1 (an empty sequence owns no
        segment); the threads test every n, strided, so N loads take N / threads rounds, not N."""
        if tidx == 0:
            s_sequence[0] = Int32(-1)
        cute.arch.sync_threads()
        sequences = seq_first_segment.shape[0] - 1
        for n in range(tidx, sequences, self.threads):
            if (seq_first_segment[n] <= segment) & (seq_first_segment[n + 1] == segment + 1):
                s_sequence[0] = n

    def chunk_state_rows(self, chunk_states: cute.Tensor, chunk, head, row_block) -> cute.Tensor:
        """This CTA's [R, K] rows of one chunk's start state in ``chunk_states`` [C_max, H, V K]."""
        R, K = self.rows, self.key_dim
        rows = cute.local_tile(chunk_states[chunk, head, None], (R * K,), (row_block,))
        return cute.make_tensor(rows.iterator, cute.make_layout((R, K), stride=(K, 1)))

    @cute.jit
    def store_chunk_state(self, s2g, tidx, state_mma, state, state_coords, s_out, s_k_all, stage, chunk_states,
                          chunk, head, row_block):
        """Mode "output_states": stage the state (rounded to the input dtype) in ``s_out``, or, without one
        (R = 64 rows: R x K is the size of a k tile), in the k tile of ``stage`` (unused until the next
        sync), then store it as chunk ``chunk``'s start state. At K = 128 the staging runs ``stmatrix``
        over the C layout of ``state_mma``; at K = 64 one store per element: there the ``stmatrix``
        staging in this loop gave wrong outputs and states on an H200, and faults, with NQ = 32
        (n_h >= 2; 2026-12-04, benchmarks/NOTES.md; cause not found), the per-element stores did not."""
        staging = s_out
        if cutlass.const_expr(s_out is None):
            base = cute.recast_ptr(s_k_all[None, None, stage].iterator, dtype=self.dtype)  # plain, 1024-aligned
            staging = cute.make_tensor(base, _mma.smem_tile_layout(self.rows, self.key_dim))
        if cutlass.const_expr(self.key_dim == 128):
            _mma.stage_accumulator_stmatrix(state_mma, tidx, state, staging)
        else:
            _mma.stage_accumulator(state, state_coords, staging)
        cute.arch.sync_threads()
        _mma.copy_tile_s2g(s2g, tidx, staging, self.chunk_state_rows(chunk_states, chunk, head, row_block))

    @cute.jit
    def chunk_step(self, products, state: cute.Tensor, stage, s_sc: cute.Tensor, s_k_all, s_v_all,
                   s_ta_all, s_tb_all, s_q_all, s_p_all, o: cute.Tensor, head, row0, first_token, tokens,
                   s_read_bad, flagged):
        """One chunk: Y, D, (O), and the state update, on the chunk's tiles in shared-memory ``stage``;
        contained, when the launch has a flagged token (``flagged``), the outputs of the tokens flagged in
        ``s_read_bad`` are stored as NaN (poisoned)."""
        R, NQ = self.rows, self.query_tile
        state_a = products.as_a(state)
        y = products.product_accumulator(C)
        products.y_from_state(y, state_a, s_k_all, stage)
        delta = products.product_accumulator(C)
        minus_y = products.as_a(y, lambda e: Float32(-1.0))
        # transition rows see zero values: their value tile stays zero (filled once), no branch here
        products.delta_from_values(delta, s_v_all, s_tb_all, stage)
        products.delta_add_y(delta, minus_y, s_ta_all, stage)

        if cutlass.const_expr(self.reads_queries):
            # O = (X q^T) diag(c) + D P^T on the chunk's tokens
            out = products.product_accumulator(NQ)
            token_coords = products.coordinates(out, (R, NQ))
            products.out_from_state(out, state_a, s_q_all, stage)
            for e in cutlass.range_constexpr(cute.size(out)):
                out[e] = out[e] * s_sc[1, token_coords[e][1]]
            products.out_add_delta(out, products.as_a(delta), s_p_all, stage)
            self.store_outputs(out, token_coords, s_q_all, stage, o, head, row0, first_token, tokens, s_read_bad,
                               flagged)

        # X <- exp(G_last) X + (D diag(b)) k
        step_coords = products.coordinates(delta, (R, C))
        scaled_delta = products.as_a(delta, lambda e: s_sc[0, step_coords[e][1]])
        decay = s_sc[2, 0]
        for e in cutlass.range_constexpr(cute.size(state)):
            state[e] = state[e] * decay
        products.update_state(state, scaled_delta, s_k_all, stage)

    @cute.jit
    def store_outputs(self, out: cute.Tensor, token_coords: cute.Tensor, s_q_all: cute.Tensor, stage,
                      o: cute.Tensor, head, row0, first_token, tokens, s_read_bad, flagged):
        """O's [R, NQ] accumulator to ``o`` through shared memory: staged token-major in this stage's q tile
        (dead once every warp's O product has read it; R <= K, so [NQ, R] fits), then stored as 16-byte runs of
        each token's R values. Per-element stores from the C fragment wrote 2 bytes each, 8 lanes per sector,
        and (contained) tested each element's flag; here a token's flag is tested once per 16-byte run: a
        flagged token (``s_read_bad``, when the launch has one) gets NaN."""
        R, NQ = self.rows, self.query_tile
        tidx, _, _ = cute.arch.thread_idx()
        plain = cute.recast_ptr(s_q_all[None, None, stage].iterator, dtype=self.dtype)  # 1024-aligned
        staging = cute.make_tensor(plain, _mma.smem_tile_layout(NQ, R))  # [token, row]
        cute.arch.sync_threads()  # every warp's O products have read the q tile
        _mma.stage_accumulator(out, token_coords, _mma.transposed_view(staging, NQ, R))
        cute.arch.sync_threads()
        rows_copy = _mma.make_s2g_copy(self.dtype, self.threads, R)
        thr = rows_copy.get_slice(tidx)
        src = thr.partition_S(staging)
        first_row = cute.assume(row0, divby=R)  # row blocks start at multiples of R: 16-byte runs stay aligned
        dst = thr.partition_D(cute.local_tile(cute.domain_offset((first_token, first_row), o[None, head, None]),
                                              (NQ, R), (0, 0)))
        coords = thr.partition_S(cute.make_identity_tensor((NQ, R)))
        for m in cutlass.range_constexpr(cute.size(src.shape[1])):
            token = coords[0, m, 0][0]
            if token < tokens:
                poisoned = False
                if cutlass.const_expr(s_read_bad is not None):
                    if flagged:
                        poisoned = s_read_bad[token] != cutlass.Uint8(0)
                if poisoned:
                    dst[None, m, None].fill(float("nan"))
                else:
                    cute.copy(rows_copy, src[None, m, None], dst[None, m, None])


class _SyncProducts:
    """The chunk's products on warp-level mma.sync: B operands through ldmatrix, every warp."""

    def __init__(self, kernel: ChunkScanKernel, tidx, tiled_mma):
        self.kernel, self.tidx, self.tiled_mma = kernel, tidx, tiled_mma
        self.state_mma = tiled_mma  # every product's C layout, the state's included
        self.thr = tiled_mma.get_slice(tidx)

    def state_accumulator(self):
        return self.product_accumulator(self.kernel.key_dim)

    def product_accumulator(self, n: int):
        acc = cute.make_rmem_tensor(self.thr.partition_shape_C((self.kernel.rows, n)), Float32)
        acc.fill(0.0)
        return acc

    def coordinates(self, acc, shape):
        return self.thr.partition_C(cute.make_identity_tensor(shape))

    def as_a(self, acc, scale_of=None):
        if scale_of is None:
            return _mma.accumulator_as_a(acc, self.kernel.dtype)
        return _scaled_as_a(acc, scale_of, self.kernel.dtype)

    def _b(self, tile, transpose=False):
        return _mma.SmemOperand(self.tiled_mma, self.tidx, tile, self.kernel.dtype, operand="B", transpose=transpose)

    def y_from_state(self, y, state_a, s_k_all, stage):
        _mma.gemm_smem_b(self.tiled_mma, y, state_a, self._b(s_k_all[None, None, stage]))

    def delta_from_values(self, delta, s_v_all, s_tb_all, stage):
        vt = _mma.SmemOperand(self.tiled_mma, self.tidx,
                              _mma.transposed_view(s_v_all[None, None, stage], C, self.kernel.rows),
                              self.kernel.dtype, operand="A", transpose=True)
        _mma.gemm_smem_ab(self.tiled_mma, delta, vt, self._b(s_tb_all[None, None, stage]))

    def delta_add_y(self, delta, minus_y, s_ta_all, stage):
        _mma.gemm_smem_b(self.tiled_mma, delta, minus_y, self._b(s_ta_all[None, None, stage]))

    def out_from_state(self, out, state_a, s_q_all, stage):
        _mma.gemm_smem_b(self.tiled_mma, out, state_a, self._b(s_q_all[None, None, stage]))

    def out_add_delta(self, out, delta_a, s_p_all, stage):
        _mma.gemm_smem_b(self.tiled_mma, out, delta_a, self._b(s_p_all[None, None, stage]))

    def update_state(self, state, scaled_delta, s_k_all, stage):
        kt = _mma.transposed_view(s_k_all[None, None, stage], C, self.kernel.key_dim)
        _mma.gemm_smem_b(self.tiled_mma, state, scaled_delta, self._b(kt, transpose=True))


class _WgmmaProducts:
    """The chunk's products on Hopper warpgroup MMAs: B (and the value tile as A) read by the tensor
    cores from shared memory through descriptors built once for both stages."""

    def __init__(self, kernel: ChunkScanKernel, tidx, s_k_all, s_v_all, s_ta_all, s_tb_all, s_q_all, s_p_all):
        K, R, NQ, dtype = kernel.key_dim, kernel.rows, kernel.query_tile, kernel.dtype
        groups = R // 64
        self.kernel = kernel
        self.state_mma = _mma.make_wgmma(dtype, groups, K, b_mn_major=True)  # X += A k (k read as k^T)
        self.step_mma = _mma.make_wgmma(dtype, groups, C)  # Y = X k^T, D -= Y Ta^T
        self.value_mma = _mma.make_wgmma(dtype, groups, C, a_from_smem=True, a_mn_major=True)  # D = v^T Tb^T
        self.state_thr = self.state_mma.get_slice(tidx)
        self.step_thr = self.step_mma.get_slice(tidx)
        value_thr = self.value_mma.get_slice(tidx)
        kt_all = _mma.wgmma_transposed_view(s_k_all, dtype, C, K, STAGES)
        vt_all = _mma.wgmma_transposed_view(s_v_all, dtype, C, R, STAGES)
        self.k_b = self.step_thr.make_fragment_B(self.step_thr.partition_B(s_k_all))
        self.kt_b = self.state_thr.make_fragment_B(self.state_thr.partition_B(kt_all))
        self.ta_b = self.step_thr.make_fragment_B(self.step_thr.partition_B(s_ta_all))
        self.tb_b = value_thr.make_fragment_B(value_thr.partition_B(s_tb_all))
        self.vt_a = value_thr.make_fragment_A(value_thr.partition_A(vt_all))
        if cutlass.const_expr(kernel.reads_queries):
            self.out_mma = _mma.make_wgmma(dtype, groups, NQ)  # O = X q^T + D P^T
            self.out_thr = self.out_mma.get_slice(tidx)
            self.q_b = self.out_thr.make_fragment_B(self.out_thr.partition_B(s_q_all))
            self.p_b = self.out_thr.make_fragment_B(self.out_thr.partition_B(s_p_all))

    def state_accumulator(self):
        acc = self.state_thr.make_fragment_C(self.state_thr.partition_shape_C((self.kernel.rows, self.kernel.key_dim)))
        acc.fill(0.0)
        return acc

    def _thr(self, n: int):
        """A thread slice whose accumulator is [R, n] (the C layout depends on N only)."""
        if n == self.kernel.key_dim:
            return self.state_thr
        return self.step_thr if n == C else self.out_thr

    def product_accumulator(self, n: int):
        thr = self._thr(n)
        return thr.make_fragment_C(thr.partition_shape_C((self.kernel.rows, n)))

    def coordinates(self, acc, shape):
        return self._thr(shape[1]).partition_C(cute.make_identity_tensor(shape))

    def as_a(self, acc, scale_of=None):
        if scale_of is not None:
            scaled = cute.make_fragment_like(acc, Float32)
            for e in range(cute.size(acc)):
                scaled[e] = acc[e] * scale_of(e)
            acc = scaled
        return _mma.accumulator_as_wgmma_a(acc, self.step_mma, self.kernel.dtype)

    def y_from_state(self, y, state_a, s_k_all, stage):
        _mma.wgmma(self.step_mma, y, state_a, self.k_b[None, None, None, stage], False)

    def delta_from_values(self, delta, s_v_all, s_tb_all, stage):
        _mma.wgmma(self.value_mma, delta, self.vt_a[None, None, None, stage], self.tb_b[None, None, None, stage],
                   False)

    def delta_add_y(self, delta, minus_y, s_ta_all, stage):
        _mma.wgmma(self.step_mma, delta, minus_y, self.ta_b[None, None, None, stage], True)

    def out_from_state(self, out, state_a, s_q_all, stage):
        _mma.wgmma(self.out_mma, out, state_a, self.q_b[None, None, None, stage], False)

    def out_add_delta(self, out, delta_a, s_p_all, stage):
        _mma.wgmma(self.out_mma, out, delta_a, self.p_b[None, None, None, stage], True)

    def update_state(self, state, scaled_delta, s_k_all, stage):
        _mma.wgmma(self.state_mma, state, scaled_delta, self.kt_b[None, None, None, stage], True)


def staged_tile(allocator, dtype, rows: int, cols: int, wgmma: bool) -> cute.Tensor:
    """A staged [rows, cols, STAGES] shared tile of one operand in the swizzle its MMA family reads
    (warpgroup MMAs want it on the pointer, not in the layout)."""
    if wgmma:
        layout = _mma.wgmma_tile_layout(dtype, rows, cols, STAGES)
        return allocator.allocate_tensor(dtype, layout.outer, 1024, swizzle=layout.inner)
    return allocator.allocate_tensor(dtype, _staged(rows, cols), 128)


def _staged(rows: int, cols: int):
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
    return cute.tile_to_shape(atom, (rows, cols, STAGES), (0, 1, 2))
