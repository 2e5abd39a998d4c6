"""The backward of ``chunk_prep``, one CTA of 8 warps per (chunk, head), float32 values throughout.

From the gradients of the prep outputs (``chunk_reverse`` wrote them: dTa, dTb [64, 64], dP
[NQ, 64], and db, dc, dd) it recomputes the chunk's forward quantities (G, f, fq, Gram = k k^T and
QK = q k^T, A, T = (I + A)^-1) and runs ``backward_algorithm.prep_backward``:

    dT = dTa diag(a) + dTb diag(beta)      da = colsum(dTa * T)      dA = -T^T dT T^T (strictly lower)
    A_ij = beta_i f_i f_j E_ij Gram_ij  ->  dbeta, df, dG and dGram;  dk += (dGram + dGram^T) k
    P_tj = scale fq_t f_j EP_tj QK_tj   ->  dfq, df, dG and dQK;      dq += dQK k, dk += dQK^T q
    b, c, d (exponentials of G)         ->  df, dfq, dG
    G = cumsum(gates)                   ->  dg = reverse cumsum of dG at each token's first step
    f = (|k|^2 + eps)^-1/2              ->  dk -= df f^3 k (and dq likewise), with l2norm

and adds the scan's parts of dq and dk. The products take float32 operands split into bf16 halves
(big + small: relative error ~2^-16, deterministic). With bf16 inputs they run on warpgroup MMAs:
the float32 squares are split once into bf16 tiles in the 128-byte swizzle (in squares free at that
point), the k and q tiles are read where they are (``smem_tile_layout`` is that swizzle), and the
two warpgroups split the work (Gram and QK: 32 columns each; step 3's squares: 32 columns each;
step 7: dk on warpgroup 0, dq on warpgroup 1). This took the kernel from 2.09 to 1.57 ms at 32k
tokens (the mma.sync products loaded every operand per warp, A from float32 shared memory, and split
it per k-slice). With fp16 inputs they run on ``mma.sync`` (``_mma.gemm_f32_split`` and
``gemm_f32_by_16bit``; fp16 keys and queries are split too). dTa, dTb and dP are staged in shared
memory by 16-byte ``cp.async`` (the first two while the inverse runs), so no loop waits on a global
load. Code that runs once per CTA is kept short (rolled loops): the kernel was instruction-fetch bound.
Eight warps (two CTAs per SM at <= 128 registers): the per-row / per-column loops of steps 4 and 5
split their terms over two threads. Timing the kernel with one phase removed at a time showed no
phase above 0.2 ms at 32k tokens but the dq/dk products: the cost is a chain of short phases between
barriers, so removing work pays, reordering does not (benchmarks/NOTES.md).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cp_linear.kernels import _chunk_common as chunk_common
from cp_linear.kernels import _mma
from cp_linear.kernels._common import cutlass_dtype, smem_vector, zero_unless
from cp_linear.kernels.configs import CHUNK_SIZE, ChunkPrepBackwardConfig

C = CHUNK_SIZE
WARPS = 8
THREADS = 32 * WARPS
WARPGROUP = 128
PITCH = C + 4


class ChunkPrepBackwardKernel:
    def __init__(self, config: ChunkPrepBackwardConfig):
        config.validate()
        self.dtype = cutlass_dtype(config.dtype)
        self.key_dim = config.key_dim
        self.query_tile = config.query_tile
        self.contained = config.contained
        if THREADS // config.query_tile not in (4, 8) or THREADS % config.query_tile:
            raise ValueError(f"chunk_prep_backward splits a query tile of 32 or 64 rows; got {config.query_tile}")
        # the float32 products run on bf16 halves (big + small); fp16 keys and queries are split too
        self.inputs_bf16 = self.dtype is cutlass.BFloat16

    @cute.jit
    def __call__(self,
                 q: cute.Tensor, k: cute.Tensor,  # [T_all, H, K], [S_all, H, K] input dtype
                 g: cute.Tensor, beta: cute.Tensor,  # [T_all, H], [S_all, H] float32
                 chunk_first_step: cute.Tensor, chunk_steps: cute.Tensor, num_chunks: cute.Tensor,
                 state_bad: cute.Tensor, read_bad: cute.Tensor,  # [T_all, H] uint8 (read when contained)
                 any_flagged: cute.Tensor,  # int32 [1]: nonzero when any token is flagged (contained)
                 d_ta: cute.Tensor, d_tb: cute.Tensor,  # [C_max, H, 64, 64] float32
                 d_p: cute.Tensor,  # [C_max, H, NQ, 64] float32
                 d_scalars: cute.Tensor,  # [C_max, H, 4, 64] float32: db, dc, dd
                 dq_scan: cute.Tensor, dk_scan: cute.Tensor,  # [T_all, H, K], [S_all, H, K] float32
                 dq: cute.Tensor, dk: cute.Tensor,  # (out) input dtype: the final gradients
                 dg: cute.Tensor, dbeta: cute.Tensor,  # (out) [T_all, H], [S_all, H] float32
                 scale: Float32, use_l2: Int32, num_householder: Int32, stream):
        # 64-row products: 4 warps along the rows, 2 along the columns
        tiled_mma = _mma.make_step_rows_mma(self.dtype, WARPS)
        split_mma = _mma.make_step_rows_mma(cutlass.BFloat16, WARPS)
        g2s = _mma.make_g2s_copy(self.dtype, THREADS)
        g2s_f32 = _mma.make_g2s_copy(Float32, THREADS)
        s2g = _mma.make_s2g_copy(self.dtype, THREADS, self.key_dim)
        s2g_warpgroup = _mma.make_s2g_copy(self.dtype, WARPGROUP, self.key_dim)
        self.kernel(q, k, g, beta, chunk_first_step, chunk_steps, num_chunks, state_bad, read_bad, any_flagged, d_ta,
                    d_tb, d_p,
                    d_scalars, dq_scan, dk_scan, dq, dk, dg, dbeta, scale, use_l2, num_householder, tiled_mma,
                    split_mma, g2s, g2s_f32, s2g, s2g_warpgroup).launch(
            grid=(chunk_first_step.shape[0], k.shape[1], 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
               chunk_first_step: cute.Tensor, chunk_steps: cute.Tensor, num_chunks: cute.Tensor,
               state_bad: cute.Tensor, read_bad: cute.Tensor, any_flagged: cute.Tensor,
               d_ta: cute.Tensor, d_tb: cute.Tensor, d_p: cute.Tensor, d_scalars: cute.Tensor,
               dq_scan: cute.Tensor, dk_scan: cute.Tensor, dq: cute.Tensor, dk: cute.Tensor, dg: cute.Tensor,
               dbeta: cute.Tensor, scale: Float32, use_l2: Int32, num_householder: Int32,
               tiled_mma: cute.TiledMma, split_mma: cute.TiledMma, g2s: cute.TiledCopy, g2s_f32: cute.TiledCopy,
               s2g: cute.TiledCopy, s2g_warpgroup: cute.TiledCopy):
        K, NQ, NH = self.key_dim, self.query_tile, num_householder
        tidx, _, _ = cute.arch.thread_idx()
        chunk, head, _ = cute.arch.block_idx()
        allocator = cutlass.utils.SmemAllocator()
        # 1024-byte aligned: the tiles (and the squares' bf16 halves in step 7) are read by warpgroup MMAs
        s_k = allocator.allocate_tensor(self.dtype, _mma.smem_tile_layout(C, K), 1024)
        s_q = allocator.allocate_tensor(self.dtype, _mma.smem_tile_layout(C, K), 1024)
        square_layout = cute.make_layout((C, C), stride=(PITCH, 1))
        square = lambda: allocator.allocate_tensor(Float32, square_layout, 1024)  # noqa: E731
        # four float32 squares, reused phase by phase (Gram and QK are recomputed where needed), so that
        # two CTAs share an SM. fp16: A -> dQK, T -> Gram -> QK, dTb -> dT -> dA -> dP, dTa -> M1 -> dGram;
        # bf16: A -> T's halves -> Gram -> dQK, T -> dA -> QK -> dQK's halves, dTb -> dT -> M1's halves ->
        # dP -> dGram's halves, dTa -> dT's halves -> dGram -> dk's staging (dq's: s_a)
        s_a, s_t, s_work, s_m1 = square(), square(), square(), square()
        s_gate, s_beta, s_f, s_fq = (smem_vector(allocator, C) for _ in range(4))
        # partial gradients by step (j) or token (t), each entry written by one thread
        s_dbeta, s_df, s_dg, s_dfq = (smem_vector(allocator, C) for _ in range(4))
        # sums of steps 4-6: S's row and column sums (two halves each), P's column sums (four quarters), dfq;
        # step 2 uses the first eight rows for its partial column sums
        s_sums = allocator.allocate_tensor(Float32, cute.make_layout((9, C), stride=(C, 1)), 16)
        s_row_s, s_col_s, s_row_s2, s_col_s2, s_dfq_total = (s_sums[r, None] for r in (0, 1, 2, 3, 8))
        s_p_parts = cute.domain_offset((4, 0), s_sums)  # rows 4-7
        s_sum = smem_vector(allocator, 2)
        s_scalars = allocator.allocate_tensor(Float32, cute.make_layout((4, C), stride=(C, 1)), 16)  # db, dc, dd

        if chunk < num_chunks[0]:
            first = chunk_first_step[chunk]
            steps = chunk_steps[chunk]
            first_token = first // NH
            tokens = steps // NH
            last_step = cutlass.max(steps - 1, 0)
            chunk_common.load_chunk_inputs(g2s, tidx, q, k, g, beta, head, first, steps, NH, s_k, s_q, s_gate,
                                           s_beta, K, chunk_common.contained_flags(self, state_bad, read_bad,
                                                                                   any_flagged))
            # the gradients of Ta and Tb into the squares that step 2 consumes first (read in step 2)
            _mma.copy_rows_g2s(g2s_f32, tidx, d_ta[chunk, head, None, None], s_m1, C)
            _mma.copy_rows_g2s(g2s_f32, tidx, d_tb[chunk, head, None, None], s_work, C)
            cute.arch.cp_async_commit_group()
            for n in cutlass.range_constexpr(4 * C // THREADS):
                flat = tidx + n * THREADS
                s_scalars[flat // C, flat % C] = d_scalars[chunk, head, flat // C, flat % C]
            chunk_common.gate_cumsum(tidx, s_gate)
            chunk_common.row_norms(tidx, s_k, s_q, s_f, s_fq, steps, tokens, use_l2, K, THREADS)
            cute.arch.fence_view_async_shared()  # cp.async data -> the warpgroup MMAs' reads (bf16)
            cute.arch.sync_threads()

            # 1. A = strictly lower beta_i f_i f_j E_ij Gram_ij (Gram = k k^T, then scaled in place by a rolled
            #    loop: this code runs once per CTA, so short code matters more than registers); T = (I + A)^-1
            self.raw_product(tiled_mma, tidx, s_k, s_k, s_a)
            cute.arch.sync_threads()
            for n in cutlass.range(C * C // THREADS, unroll=2):
                flat = tidx + n * THREADS
                i = flat // C
                j = flat % C
                scaled = s_beta[i] * s_f[i] * s_f[j] * cute.math.exp(s_gate[i] - s_gate[j]) * s_a[i, j]
                s_a[i, j] = zero_unless(j < i, scaled)
            cute.arch.sync_threads()
            chunk_common.invert_unit_lower(tidx, s_a, s_t, THREADS)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()

            # 2. dT = dTa diag(a) + dTb diag(beta) (in place of dTb); da = colsum(dTa * T) -> dbeta, df, dG. Every
            #    thread takes a quarter of column j's rows (one thread per column left 6 of 8 warps idle through
            #    a 64-long chain of shared loads); thread j adds the four partial sums
            j = tidx % C
            quarter = tidx // C
            growth = cute.math.exp(s_gate[j])
            a_j = s_beta[j] * s_f[j] * growth
            da = Float32(0.0)
            dbeta_t = Float32(0.0)
            for ii in cutlass.range(C // 4, unroll=4):
                i = quarter * (C // 4) + ii
                grad_a = s_m1[i, j]
                grad_b = s_work[i, j]
                t_ij = s_t[i, j]
                da = da + grad_a * t_ij
                dbeta_t = dbeta_t + grad_b * t_ij
                s_work[i, j] = grad_a * a_j + grad_b * s_beta[j]
            s_sums[quarter, j] = da
            s_sums[4 + quarter, j] = dbeta_t
            cute.arch.sync_threads()
            if tidx < C:
                da = s_sums[0, j] + s_sums[1, j] + s_sums[2, j] + s_sums[3, j]
                dbeta_t = s_sums[4, j] + s_sums[5, j] + s_sums[6, j] + s_sums[7, j]
                s_dbeta[j] = dbeta_t + da * s_f[j] * growth
                s_df[j] = da * s_beta[j] * growth
                s_dg[j] = da * a_j
            cute.arch.sync_threads()

            # 3. dA = -T^T dT T^T (its strictly lower part is read): M1 = T^T dT, then dA = -M1 T^T; Gram again
            if cutlass.const_expr(self.inputs_bf16):
                s_da, s_gram = s_t, s_a
                self.square_products_wgmma(tidx, s_t, s_work, s_a, s_m1, s_da)
            else:
                s_da, s_gram = s_work, s_t
                square_product(tidx, split_mma, float_transposed(s_t), float_transposed(s_work), s_m1, False)
                cute.arch.sync_threads()
                square_product(tidx, split_mma, s_m1, s_t, s_da, True)
            cute.arch.sync_threads()
            self.raw_product(tiled_mma, tidx, s_k, s_k, s_gram)  # (T is consumed)
            cute.arch.sync_threads()

            # 4. through A: rows (threads 0-63) and columns (64-127) of S = dA E Gram, half the terms each;
            #    threads 128-255 the other half of the same lines. W = dA A needs no pass of its own: its row
            #    sums are beta_i f_i (S f)_i and its column sums f_j (beta f S)_j (step 6). A row's terms
            #    start at a rotated index (with a row pitch of 68 words, lanes reading one column of 32 rows
            #    hit 8 banks: 4-way conflicts). The row threads also write dGram + dGram^T into s_m1 (both
            #    triangles; its diagonal is written in step 7)
            line = tidx % C
            parity = (tidx // (2 * C)) % 2
            sum_s = Float32(0.0)
            if tidx % (2 * C) < C:
                row_scale = s_beta[line] * s_f[line]
                for jj in cutlass.range(C // 2, unroll=4):
                    j = (C // 2) * parity + (jj + line) % (C // 2)  # rotated: lanes hit distinct banks
                    if j < line:
                        weighted = s_da[line, j] * cute.math.exp(s_gate[line] - s_gate[j]) * s_f[j]
                        sum_s = sum_s + weighted * s_gram[line, j]
                        grad_gram = weighted * row_scale
                        s_m1[line, j] = grad_gram
                        s_m1[j, line] = grad_gram
                if parity == 0:
                    s_row_s[line] = sum_s
                else:
                    s_row_s2[line] = sum_s
            else:
                for ii in cutlass.range(C // 2, unroll=4):
                    i = 2 * ii + parity
                    if i > line:
                        grad_a = s_da[i, line]
                        s_ij = grad_a * cute.math.exp(s_gate[i] - s_gate[line]) * s_gram[i, line]
                        sum_s = sum_s + s_ij * s_beta[i] * s_f[i]
                if parity == 0:
                    s_col_s[line] = sum_s
                else:
                    s_col_s2[line] = sum_s
            cute.arch.sync_threads()

            # 5. through P: dP staged in s_work (dA is consumed), QK = q k^T in s_t (Gram is consumed), dQK into s_a
            #    (A is consumed). U = dP P is not summed: its row sums are fq_t dfq_t and its column sums f_j col_p_j
            #    (step 6). a) the NQ token rows on every thread (THREADS / NQ per row, their columns interleaved
            #    so that a warp's lanes hit distinct banks): dQK and dfq; loads and exponentials unconditional,
            #    then selected. b) P's column sums from dQK: f_j col_p_j = sum_t dQK_tj QK_tj (two reads a term,
            #    no exponential), a quarter of the tokens per thread
            _mma.copy_rows_g2s(g2s_f32, tidx, d_p[chunk, head, None, None], cute.local_tile(s_work, (NQ, C), (0, 0)),
                               NQ)
            cute.arch.cp_async_commit_group()
            self.raw_product(tiled_mma, tidx, s_q, s_k, s_t)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            row_threads = THREADS // NQ
            t = tidx // row_threads
            part = tidx % row_threads
            row_ok = t < tokens
            last = cutlass.min(t * NH + NH - 1, C - 1)
            gate_last_t = s_gate[last]
            fq_t = s_fq[t]
            dfq_t = Float32(0.0)
            for jj in cutlass.range(C // row_threads, unroll=4):
                j = row_column(part, jj, row_threads)
                keep = row_ok & (j <= last)
                weighted = s_work[t, j] * scale * cute.math.exp(gate_last_t - s_gate[j]) * s_f[j]
                dfq_t = dfq_t + zero_unless(keep, weighted * s_t[t, j])
                s_a[t, j] = zero_unless(keep, weighted * fq_t)
            for d in cutlass.range_constexpr(row_threads.bit_length() - 1):  # the row's threads are adjacent lanes
                dfq_t = dfq_t + cute.arch.shuffle_sync_bfly(dfq_t, 1 << d)
            if part == 0:
                s_dfq[t] = dfq_t
            if cutlass.const_expr(NQ < C):  # dQK's rows past the query tile feed dk's product: zero
                for n in cutlass.range_constexpr((C - NQ) * C // THREADS):
                    flat = tidx + n * THREADS
                    s_a[NQ + flat // C, flat % C] = Float32(0.0)
            cute.arch.sync_threads()
            j = tidx % C
            quarter = tidx // C
            p_part = Float32(0.0)
            for tt in cutlass.range(NQ // 4, unroll=4):
                t = quarter * (NQ // 4) + tt
                p_part = p_part + s_a[t, j] * s_t[t, j]
            s_p_parts[quarter, j] = p_part
            cute.arch.sync_threads()

            # the products' accumulators start as the scan's parts: their global loads are issued here and waited
            # for in the products, so steps 6 and 7's first loops run under their latency. bf16: warpgroup 0
            # accumulates dk, warpgroup 1 dq on warpgroup MMAs; fp16: every warp dk, then dq, on mma.sync
            if cutlass.const_expr(self.inputs_bf16):
                wg_mma = _mma.make_wgmma(self.dtype, 1, K, a_from_smem=True, b_mn_major=True)
                wg_thr = wg_mma.get_slice(tidx % WARPGROUP)
                out_coords = wg_thr.partition_C(cute.make_identity_tensor((C, K)))
                acc = wg_thr.make_fragment_C(wg_thr.partition_shape_C((C, K)))
                if tidx < WARPGROUP:
                    load_rows(acc, out_coords, dk_scan, first, steps, head)
                else:
                    load_rows(acc, out_coords, dq_scan, first_token, tokens, head)
            else:
                out_thr = split_mma.get_slice(tidx)
                out_coords = out_thr.partition_C(cute.make_identity_tensor((C, K)))
                acc = cute.make_rmem_tensor(out_thr.partition_shape_C((C, K)), Float32)
                load_rows(acc, out_coords, dk_scan, first, steps, head)

            # 6. assemble df, dbeta, dG per step and dfq per token; dg = reverse cumsum of dG
            gate_last = s_gate[last_step]
            if tidx < C:
                j = tidx
                grad_b = s_scalars[0, j]
                b_j = s_f[j] * cute.math.exp(gate_last - s_gate[j])
                row_s = s_row_s[j] + s_row_s2[j]
                col_s = s_col_s[j] + s_col_s2[j]
                f_col_p = s_p_parts[0, j] + s_p_parts[1, j] + s_p_parts[2, j] + s_p_parts[3, j]
                col_p = zero_unless(s_f[j] != 0.0, f_col_p / s_f[j])  # f = 0 only on padding steps (col_p 0)
                s_df[j] = s_df[j] + s_beta[j] * row_s + col_s + col_p + grad_b * cute.math.exp(gate_last - s_gate[j])
                s_dbeta[j] = s_dbeta[j] + s_f[j] * row_s
                # W = dA A and U = dP P: row sum of W minus the column sums of W and U
                grad_g = s_dg[j] + s_f[j] * (s_beta[j] * row_s - col_s) - f_col_p - grad_b * b_j
                if j % NH == NH - 1:  # token j // n_h ends here: its P rows (U's row sum) and c read exp(G_j)
                    t = j // NH
                    if t < tokens:
                        c_t = scale * s_fq[t] * cute.math.exp(s_gate[j])
                        grad_g = grad_g + s_fq[t] * s_dfq[t] + s_scalars[1, t] * c_t
                s_dg[j] = grad_g
                bb = cute.arch.warp_reduction_sum(grad_b * b_j)
                if tidx % 32 == 0:
                    s_sum[tidx // 32] = bb
            elif tidx < 2 * C:  # every token slot (step 7's diagonal reads all 64): zero past the chunk's tokens
                t = tidx - C
                token_end = cutlass.min(t * NH + NH - 1, C - 1)
                s_dfq_total[t] = zero_unless(t < tokens, s_dfq[t] + s_scalars[1, t] * scale *
                                             cute.math.exp(s_gate[token_end]))
            cute.arch.sync_threads()
            if tidx == 0:
                s_dg[last_step] = s_dg[last_step] + s_sum[0] + s_sum[1] + \
                    s_scalars[2, 0] * cute.math.exp(gate_last)
            cute.arch.sync_threads()
            reverse_cumsum(tidx, s_dg)
            cute.arch.sync_threads()
            if tidx < C:
                j = tidx
                if j < steps:
                    dbeta[first + j, head] = s_dbeta[j]
                    if j % NH == 0:
                        dg[first_token + j // NH, head] = s_dg[j]

            # 7. dk = dk_scan + (dGram + dGram^T - diag(df f^3)) k + dQK^T q;  dq = dq_scan + dQK k - diag(dfq fq^3) q
            #    (dGram's diagonal is zero: the key term rides in dk's product)
            if tidx < C:
                s_m1[tidx, tidx] = -zero_unless(use_l2 != 0, s_df[tidx] * s_f[tidx] * s_f[tidx] * s_f[tidx])
            if cutlass.const_expr(self.inputs_bf16):
                cute.arch.sync_threads()
                self.products_wgmma(tidx, acc, out_coords, s_k, s_q, s_a, s_t, s_work, s_m1, s_fq, s_dfq_total,
                                    s2g_warpgroup, dq, dk, first, steps, first_token, tokens, head, use_l2)
            else:
                self.products_sync(tidx, tiled_mma, split_mma, acc, out_coords, s_k, s_q, s_a, s_t, s_work, s_m1,
                                   s_fq, s_dfq_total, s2g, dq_scan, dq, dk, first, steps, first_token, tokens, head,
                                   use_l2)

    @cute.jit
    def products_sync(self, tidx, tiled_mma, split_mma, dk_acc, out_coords, s_k, s_q, s_a, s_t, s_work, s_m1, s_fq,
                      s_dfq_total, s2g, dq_scan, dq, dk, first, steps, first_token, tokens, head, use_l2):
        """Step 7 on ``mma.sync`` (every warp; fp16 inputs, split into bf16 halves): the query diagonal rides
        in dq's product (s_t, free since step 5, holds it), so the epilogues only store: through a free
        square (dk: s_work, dq: s_m1, read by dk's product) as 16-byte rows. dq's scan part is loaded while
        dk is stored."""
        K = self.key_dim
        for n in cutlass.range(C * C // THREADS, unroll=2):
            flat = tidx + n * THREADS
            i = flat // C
            cube_q = zero_unless(use_l2 != 0, s_dfq_total[i] * s_fq[i] * s_fq[i] * s_fq[i])
            s_t[i, flat % C] = zero_unless(i == flat % C, -cube_q)
        cute.arch.sync_threads()
        self.accumulate_products(tidx, tiled_mma, split_mma, dk_acc, s_m1, s_k, float_transposed(s_a), s_q)
        staged_dk = _mma.staging_view(s_work, self.dtype, C, K)
        _mma.stage_accumulator(dk_acc, out_coords, staged_dk)
        dq_acc = cute.make_rmem_tensor(split_mma.get_slice(tidx).partition_shape_C((C, K)), Float32)
        load_rows(dq_acc, out_coords, dq_scan, first_token, tokens, head)
        cute.arch.sync_threads()
        self.store_rows(tidx, s2g, staged_dk, dk, first, steps, head)
        self.accumulate_products(tidx, tiled_mma, split_mma, dq_acc, s_a, s_k, s_t, s_q)
        staged_dq = _mma.staging_view(s_m1, self.dtype, C, K)  # s_m1: dk's product has read it (synced)
        _mma.stage_accumulator(dq_acc, out_coords, staged_dq)
        cute.arch.sync_threads()
        self.store_rows(tidx, s2g, staged_dq, dq, first_token, tokens, head)

    @cute.jit
    def products_wgmma(self, tidx, acc, out_coords, s_k, s_q, s_a, s_t, s_work, s_m1, s_fq, s_dfq_total,
                       s2g_warpgroup, dq, dk, first, steps, first_token, tokens, head, use_l2):
        """Step 7 on warpgroup MMAs (bf16 inputs): the float32 squares dGram (s_m1) and dQK (s_a) are split
        once into bf16 halves, stored as warpgroup-MMA tiles in the free squares (s_work, s_t), then
        warpgroup 0 runs dk's four products and warpgroup 1 dq's two, each on its own accumulator (the scan
        part), both reading k and q where they are (the swizzle of ``smem_tile_layout`` is the 128-byte
        one warpgroup MMAs read). The query diagonal is added in dq's epilogue (float32). Each warpgroup
        stages its output in a square the split has consumed (dk: s_m1, dq: s_a) behind its own barrier."""
        K, dtype = self.key_dim, self.dtype
        gram_big, gram_small = square_halves(s_work, dtype)
        dqk_big, dqk_small = square_halves(s_t, dtype)
        split_square(tidx, s_m1, gram_big[0], gram_small[0])
        split_square(tidx, s_a, dqk_big[0], dqk_small[0])
        cute.arch.fence_view_async_shared()  # thread stores (and cp.async data) -> the tensor cores' reads
        cute.arch.sync_threads()
        warpgroup = tidx // WARPGROUP
        local = tidx % WARPGROUP
        k_t = _mma.wgmma_transposed(_mma.as_wgmma_tile(s_k, dtype, C, K), dtype, C, K)
        # each branch makes its own MMAs: an MMA's accumulate flag is state, set inside the branch
        if warpgroup == 0:
            by_step = _mma.make_wgmma(dtype, 1, K, a_from_smem=True, b_mn_major=True)
            thr = by_step.get_slice(local)
            by_token = _mma.make_wgmma(dtype, 1, K, a_from_smem=True, a_mn_major=True, b_mn_major=True)
            thr_t = by_token.get_slice(local)
            q_t = _mma.wgmma_transposed(_mma.as_wgmma_tile(s_q, dtype, C, K), dtype, C, K)
            _mma.wgmma_sum(acc, [
                (by_step, _mma.wgmma_operand(thr, gram_big[1], "A"), _mma.wgmma_operand(thr, k_t, "B")),
                (by_step, _mma.wgmma_operand(thr, gram_small[1], "A"), _mma.wgmma_operand(thr, k_t, "B")),
                (by_token, _mma.wgmma_operand(thr_t, _mma.wgmma_transposed(dqk_big[1], dtype, C, C), "A"),
                 _mma.wgmma_operand(thr_t, q_t, "B")),
                (by_token, _mma.wgmma_operand(thr_t, _mma.wgmma_transposed(dqk_small[1], dtype, C, C), "A"),
                 _mma.wgmma_operand(thr_t, q_t, "B"))])
            staged = _mma.staging_view(s_m1, dtype, C, K)
            _mma.stage_accumulator(acc, out_coords, staged)
            cute.arch.barrier(barrier_id=1, number_of_threads=WARPGROUP)
            self.store_rows(local, s2g_warpgroup, staged, dk, first, steps, head)
        else:
            by_step = _mma.make_wgmma(dtype, 1, K, a_from_smem=True, b_mn_major=True)
            thr = by_step.get_slice(local)
            _mma.wgmma_sum(acc, [
                (by_step, _mma.wgmma_operand(thr, dqk_big[1], "A"), _mma.wgmma_operand(thr, k_t, "B")),
                (by_step, _mma.wgmma_operand(thr, dqk_small[1], "A"), _mma.wgmma_operand(thr, k_t, "B"))])
            for e in cutlass.range_constexpr(cute.size(acc)):
                t, c = out_coords[e]
                cube_q = zero_unless(use_l2 != 0, s_dfq_total[t] * s_fq[t] * s_fq[t] * s_fq[t])
                acc[e] = acc[e] - cube_q * s_q[t, c].to(Float32)
            staged = _mma.staging_view(s_a, dtype, C, K)
            _mma.stage_accumulator(acc, out_coords, staged)
            cute.arch.barrier(barrier_id=2, number_of_threads=WARPGROUP)
            self.store_rows(local, s2g_warpgroup, staged, dq, first_token, tokens, head)

    @cute.jit
    def raw_product(self, tiled_mma, tidx, s_left, s_k, out: cute.Tensor):
        """out = left k^T (64 x 64) of two 16-bit [64, K] tiles as a float32 square (Gram = k k^T, QK = q k^T,
        recomputed where needed): bf16 on warpgroup MMAs (warpgroup g the columns [32 g, 32 g + 32)),
        fp16 on ``mma.sync``."""
        if cutlass.const_expr(self.inputs_bf16):
            K, half = self.key_dim, C // 2
            column_half = tidx // WARPGROUP
            mma = _mma.make_wgmma(self.dtype, 1, half, a_from_smem=True)
            thr = mma.get_slice(tidx % WARPGROUP)
            acc = thr.make_fragment_C(thr.partition_shape_C((C, half)))
            keys = cute.local_tile(_mma.as_wgmma_tile(s_k, self.dtype, C, K), (half, K), (column_half, 0))
            _mma.wgmma(mma, acc, _mma.wgmma_operand(thr, _mma.as_wgmma_tile(s_left, self.dtype, C, K), "A"),
                       _mma.wgmma_operand(thr, keys, "B"), False)
            thr.partition_C(cute.local_tile(out, (C, half), (0, column_half))).store(acc.load())
        else:
            thr = tiled_mma.get_slice(tidx)
            acc = cute.make_rmem_tensor(thr.partition_shape_C((C, C)), Float32)
            acc.fill(0.0)
            _mma.gemm_smem_ab_rolled(
                tiled_mma, acc, _mma.SmemOperand(tiled_mma, tidx, s_left, self.dtype, operand="A", transpose=False),
                _mma.SmemOperand(tiled_mma, tidx, s_k, self.dtype, operand="B", transpose=False))
            thr.partition_C(out).store(acc.load())

    @cute.jit
    def square_products_wgmma(self, tidx, s_t, s_dt, s_free, s_free2, s_da):
        """Step 3 on warpgroup MMAs: M1 = T^T dT, then dA = -M1 T^T into ``s_da`` (float32, may be ``s_t``),
        each a float32 product of bf16 halves (big small + small big + big big, as ``_mma.gemm_f32_split``);
        warpgroup g computes the columns [32 g, 32 g + 32). T's halves go to ``s_free`` as stored (the A of
        M1 read MN-major, the B of dA), dT's transposed to ``s_free2`` (B of M1), M1's to ``s_dt`` (dT is
        consumed by its split)."""
        bf16, half = cutlass.BFloat16, C // 2
        column_half = tidx // WARPGROUP
        local = tidx % WARPGROUP
        t_big, t_small = square_halves(s_free, bf16)
        dt_big, dt_small = square_halves(s_free2, bf16)
        split_square(tidx, s_t, t_big[0], t_small[0])
        split_square(tidx, float_transposed(s_dt), dt_big[0], dt_small[0])
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
        mine = lambda tile: cute.local_tile(tile[1], (half, C), (column_half, 0))  # noqa: E731  (rows = columns n)

        # M1 = T^T dT: A[i, k] = T[k, i] (T's halves read MN-major), B[n, k] = dT[k, n]
        by_t = _mma.make_wgmma(bf16, 1, half, a_from_smem=True, a_mn_major=True)
        thr = by_t.get_slice(local)
        acc = thr.make_fragment_C(thr.partition_shape_C((C, half)))
        t_t = [_mma.wgmma_operand(thr, _mma.wgmma_transposed(x[1], bf16, C, C), "A") for x in (t_big, t_small)]
        dt = [_mma.wgmma_operand(thr, mine(x), "B") for x in (dt_big, dt_small)]
        _mma.wgmma_sum(acc, split_product_terms(by_t, t_t, dt), accumulate=False)
        m1_big, m1_small = square_halves(s_dt, bf16)
        coords = thr.partition_C(cute.make_identity_tensor((C, half)))
        for e in cutlass.range_constexpr(cute.size(acc)):
            i, c = coords[e]
            big = acc[e].to(bf16)
            m1_big[0][i, half * column_half + c] = big
            m1_small[0][i, half * column_half + c] = (acc[e] - big.to(Float32)).to(bf16)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()

        # dA = -M1 T^T: A = M1, B[n, k] = T[n, k]
        by_m1 = _mma.make_wgmma(bf16, 1, half, a_from_smem=True)
        thr = by_m1.get_slice(local)
        m1 = [_mma.wgmma_operand(thr, x[1], "A") for x in (m1_big, m1_small)]
        t_rows = [_mma.wgmma_operand(thr, mine(x), "B") for x in (t_big, t_small)]
        _mma.wgmma_sum(acc, split_product_terms(by_m1, m1, t_rows), accumulate=False)
        thr.partition_C(cute.local_tile(s_da, (C, half), (0, column_half))).store(-acc.load())

    def transposed_operand(self, tiled_mma, tidx, s_tile):
        """The [K, 64] transpose of a [64, K] input-dtype tile as the B operand (ldmatrix.trans), partitioned
        by the input-dtype MMA so that its fragment has the input type (same layout as the bf16 MMA's)."""
        return _mma.SmemOperand(tiled_mma, tidx, _mma.transposed_view(s_tile, C, self.key_dim), self.dtype,
                                operand="B", transpose=True)

    @cute.jit
    def accumulate_products(self, tidx, tiled_mma, split_mma, acc: cute.Tensor, first_left, first_right, second_left,
                            second_right):
        """acc += first_left first_right^T + second_left second_right^T for 64 rows x K (float32 left squares,
        input-dtype [64, K] right tiles read transposed), on the bf16 tensor cores:
            dk = dk_scan + G k + dQK^T q        (G = dGram + dGram^T - diag(df f^3))
            dq = dq_scan + dQK k + D q          (D = -diag(dfq fq^3); rows past the chunk's tokens are zero)"""
        _mma.gemm_f32_by_16bit(split_mma, tidx, acc, first_left, self.transposed_operand(tiled_mma, tidx, first_right),
                               self.inputs_bf16)
        _mma.gemm_f32_by_16bit(split_mma, tidx, acc, second_left,
                               self.transposed_operand(tiled_mma, tidx, second_right), self.inputs_bf16)

    @cute.jit
    def store_rows(self, tidx, s2g: cute.TiledCopy, staged: cute.Tensor, out: cute.Tensor, row0, rows, head):
        """The staged 64 x K input-dtype rows (a free float32 square holds them) to out[row0 : row0 + rows, head]."""
        g_out = cute.local_tile(cute.domain_offset((row0, 0), out[None, head, None]), (C, self.key_dim), (0, 0))
        _mma.copy_rows_s2g(s2g, tidx, staged, g_out, rows)


@cute.jit
def load_rows(acc: cute.Tensor, coords: cute.Tensor, scan: cute.Tensor, row0, rows, head):
    """acc <- scan[row0 + r, head, c] (the products then accumulate on top), from clamped rows with no branch
    around a load: a load under a branch is waited for alone (64 round trips per thread instead of one).
    In the C fragments of both ``mma.sync`` and warpgroup MMAs a thread's values 2 e and 2 e + 1 are
    columns (c, c + 1) of one row: one 8-byte load each (4-byte loads used half of every 32-byte sector, ncu)."""
    for e in cutlass.range_constexpr(0, cute.size(acc), 2):
        r, c = coords[e]
        row = scan[row0 + cutlass.min(r, rows - 1), head, None]
        # c is even and rows start 16-byte aligned (the launch's spec): say so, the compiler cannot see it
        at = cute.make_ptr(Float32, cute.local_tile(row, (2,), (c // 2,)).iterator.toint(),
                           cute.AddressSpace.gmem, assumed_align=8)
        pair = cute.make_tensor(at, cute.make_layout(2)).load()
        acc[e] = pair[0]
        acc[e + 1] = pair[1]


def square_halves(square: cute.Tensor, dtype):
    """Two [64, 64] 16-bit tiles in the float32 square's memory (1024-byte aligned; 2 x 8 KB of its 17 KB),
    each as (thread view in ``smem_tile_layout``, the same memory as a warpgroup-MMA tile)."""
    halves = []
    for byte_offset in (0, C * C * dtype.width // 8):
        pointer = cute.recast_ptr(square.iterator + byte_offset // 4, dtype=dtype)
        thread_view = cute.make_tensor(pointer, _mma.smem_tile_layout(C, C))
        halves.append((thread_view, _mma.wgmma_tile_on(pointer, dtype, C, C)))
    return halves


def split_product_terms(tiled_mma, a_halves, b_halves) -> list:
    """The ``_mma.wgmma_sum`` terms of a float32 product of operands given as (big, small) bf16 halves:
    small big + big small + big big, in ``_mma.gemm_f32_split``'s order (small small is below 2^-16)."""
    (a_big, a_small), (b_big, b_small) = a_halves, b_halves
    return [(tiled_mma, a_small, b_big), (tiled_mma, a_big, b_small), (tiled_mma, a_big, b_big)]


@cute.jit
def split_square(tidx, square: cute.Tensor, big: cute.Tensor, small: cute.Tensor):
    """big, small <- the bf16 halves of the float32 [64, 64] square (``_mma._split_bf16``; a transposed view
    too), eight columns per thread and pass, lanes along the rows: the float32 reads (row pitch 68 words,
    or one column of a transposed view) and the 16-byte stores (the swizzle keeps groups of eight whole)
    are free of bank conflicts."""
    for n in cutlass.range_constexpr(C * C // (8 * THREADS)):
        flat = tidx + n * THREADS
        row = flat % C
        group = flat // C
        _mma._split_bf16(cute.local_tile(square, (1, 8), (row, group)).load(),
                         cute.local_tile(big, (1, 8), (row, group)), cute.local_tile(small, (1, 8), (row, group)))


def row_column(part, jj, row_threads: int):
    """Column of the ``jj``-th term of thread ``part`` of a token row's ``row_threads`` (step 5): with a row
    pitch of 68 words, a warp's lanes read 32 distinct banks (8 rows x 4 threads: plain stride; 4 rows x 8
    threads: rows sit 4 banks apart, so the 8 threads take columns {0-3, 16-19} + 4 (jj % 4) + 32 (jj // 4))."""
    if row_threads == 8:
        return part % 4 + 16 * (part // 4) + 4 * (jj % 4) + 32 * (jj // 4)
    return part + row_threads * jj


def float_transposed(tile: cute.Tensor) -> cute.Tensor:
    """[C, C] transposed view of a float32 square (element (j, i) is tile[i, j])."""
    return cute.make_tensor(tile.iterator, cute.make_layout((C, C), stride=(1, PITCH)))


@cute.jit
def square_product(tidx, split_mma, left: cute.Tensor, right_t: cute.Tensor, out: cute.Tensor,
                   negate: cutlass.Constexpr):
    """out = (-) left right for 64 x 64 float32 tiles on the bf16 tensor cores (split operands; ``right_t``
    is the [N, K] view of right). For dA = -(M1 T^T) the whole square is written: its readers take
    the strictly lower part only."""
    thr = split_mma.get_slice(tidx)
    acc = cute.make_rmem_tensor(thr.partition_shape_C((C, C)), Float32)
    acc.fill(0.0)
    _mma.gemm_f32_split(split_mma, tidx, acc, left, right_t)
    result = acc.load()
    if cutlass.const_expr(negate):
        result = -result
    thr.partition_C(out).store(result)


@cute.jit
def reverse_cumsum(tidx, s_values: cute.Tensor):
    """s_values[i] <- sum of s_values[j] for j >= i over 64 entries (warp 0, two per lane)."""
    if tidx < 32:
        high = s_values[63 - 2 * tidx]
        pair_total = high + s_values[62 - 2 * tidx]
        scan = pair_total
        for d in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(scan, 1 << d)
            if tidx >= (1 << d):
                scan = scan + up
        s_values[63 - 2 * tidx] = scan - pair_total + high
        s_values[62 - 2 * tidx] = scan
