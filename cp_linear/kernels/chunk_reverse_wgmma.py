"""``ChunkReverseKernel`` on Hopper warpgroup MMAs (``ChunkReverseConfig.mma == "wgmma"``, V = 128).

The same algebra, roundings and outputs as the warp ``mma.sync`` kernel in ``chunk_reverse``
(emulated by ``emulation_backward.emulate_chunk_reverse``); only sums run in another (fixed) order.
There every one of the 8 warps loaded every B operand through ldmatrix and the kernel was bound by
instruction issue (ncu: 3.3k instructions per warp, no eligible warp in 64-77 % of cycles); here the
tensor cores read B, and A where it is a stored tile, straight from shared memory. One CTA of two
warpgroups per (chunk, head):

* values phase, rows = value rows (warpgroup g owns rows [64 g, 64 g + 64)): Y = X k^T, D, M1 =
  dX k^T, db, dD, dv, Z = dD Ta and dd;
* steps phase, rows = steps (or keys): the products are independent, so each warpgroup runs its
  own with its own staging tile and named barrier: warpgroup 0 dP and dk, warpgroup 1 dTb, dTa and
  R = X^T dO^T (dq, dc).

Every tile is stored in the 128-byte-swizzled K-major layout warpgroup MMAs read; a product that
needs a tile transposed reads it MN-major (``_mma.wgmma_transposed_view``), never a copy.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cp_linear.kernels import _chunk_common as chunk_common
from cp_linear.kernels import _mma
from cp_linear.kernels._common import cutlass_dtype
from cp_linear.kernels.configs import CHUNK_SIZE, ChunkReverseConfig

C = CHUNK_SIZE
WARPGROUP = 128
STAGING_WORDS = C * (C + 4)  # one [64, 64] float32 output, rows padded by 16 bytes (``_mma.staging_view``)


@cute.jit
def column_sums(acc: cute.Tensor, coords: cute.Tensor, s_red: cute.Tensor, tidx):
    """Per-column sums of a warpgroup-MMA accumulator ((2, 2, N / 8), M tiles, 1) over the rows each
    warp holds, in a fixed order (deterministic): a thread adds its rows (the row bit and the M
    tiles), lanes 4 apart (same columns) add by shuffles, lanes 0-3 write ``s_red[warp, column]``.
    Every warp holds every column, so every row of ``s_red`` of the calling warps is written."""
    warp = tidx // 32
    lane = tidx % 32
    for n in cutlass.range_constexpr(acc.shape[0][2]):
        for c in cutlass.range_constexpr(2):
            value = Float32(0.0)
            for m in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                for r in cutlass.range_constexpr(2):
                    value = value + acc[(c, r, n), m, 0]
            for offset in cutlass.range_constexpr(2, 5):
                value = value + cute.arch.shuffle_sync_bfly(value, offset=1 << offset)
            if lane < 4:
                s_red[warp, coords[(c, 0, n), 0, 0][1]] = value


def _accumulator(thr, rows: int, cols: int) -> cute.Tensor:
    return thr.make_fragment_C(thr.partition_shape_C((rows, cols)))


class ChunkReverseWgmmaKernel:
    def __init__(self, config: ChunkReverseConfig):
        config.validate()  # mma "wgmma" only with V = 128: two warpgroups of 64 value rows
        self.dtype = cutlass_dtype(config.dtype)
        self.key_dim = config.key_dim
        self.value_dim = config.value_dim
        self.query_tile = config.query_tile
        self.threads = 2 * WARPGROUP
        self.contained = config.contained

    @cute.jit
    def __call__(self, k: cute.Tensor, v: cute.Tensor, q: cute.Tensor, do: cute.Tensor, ta: cute.Tensor,
                 tb: cute.Tensor, p: cute.Tensor, scalars: cute.Tensor, chunk_first_step: cute.Tensor,
                 chunk_steps: cute.Tensor, num_chunks: cute.Tensor, chunk_states: cute.Tensor,
                 chunk_grads: cute.Tensor, state_bad: cute.Tensor, read_bad: cute.Tensor, any_flagged: cute.Tensor,
                 dv: cute.Tensor,
                 dq_scan: cute.Tensor, dk_scan: cute.Tensor, d_ta: cute.Tensor, d_tb: cute.Tensor, d_p: cute.Tensor,
                 d_scalars: cute.Tensor, num_householder: Int32, stream):
        """Arguments as ``chunk_reverse.ChunkReverseKernel`` (``launch.ChunkReverseLaunch``)."""
        g2s = _mma.make_g2s_copy(self.dtype, self.threads)
        s2g_values = _mma.make_s2g_copy(self.dtype, self.threads, self.value_dim)
        s2g_square = _mma.make_s2g_copy(Float32, WARPGROUP, C)  # one warpgroup's [., 64] float32 outputs
        s2r_keys = _mma.make_s2g_copy(self.dtype, self.threads, self.key_dim)  # 16-byte reads of [., K] tiles
        self.kernel(k, v, q, do, ta, tb, p, scalars, chunk_first_step, chunk_steps, num_chunks, chunk_states,
                    chunk_grads, state_bad, read_bad, any_flagged, dv, dq_scan, dk_scan, d_ta, d_tb, d_p, d_scalars,
                    num_householder,
                    g2s, s2g_values, s2g_square, s2r_keys).launch(
            grid=(chunk_first_step.shape[0], k.shape[1], 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, k: cute.Tensor, v: cute.Tensor, q: cute.Tensor, do: cute.Tensor, ta: cute.Tensor,
               tb: cute.Tensor, p: cute.Tensor, scalars: cute.Tensor, chunk_first_step: cute.Tensor,
               chunk_steps: cute.Tensor, num_chunks: cute.Tensor, chunk_states: cute.Tensor,
               chunk_grads: cute.Tensor, state_bad: cute.Tensor, read_bad: cute.Tensor, any_flagged: cute.Tensor,
               dv: cute.Tensor,
               dq_scan: cute.Tensor, dk_scan: cute.Tensor, d_ta: cute.Tensor, d_tb: cute.Tensor, d_p: cute.Tensor,
               d_scalars: cute.Tensor, num_householder: Int32, g2s: cute.TiledCopy, s2g_values: cute.TiledCopy,
               s2g_square: cute.TiledCopy, s2r_keys: cute.TiledCopy):
        K, V, NQ, NH, dtype = self.key_dim, self.value_dim, self.query_tile, num_householder, self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        chunk, head, _ = cute.arch.block_idx()
        allocator = cutlass.utils.SmemAllocator()
        tiles = dict(k=(C, K), v=(C, V), q=(NQ, K), do=(NQ, V), x=(V, K), dx=(V, K), d=(V, C), dd=(V, C), z=(V, C))
        s = {name: _mma.wgmma_tile(allocator, dtype, *shape) for name, shape in tiles.items()}
        # Ta, Tb and P share one region, free after the values phase: warpgroup 1 then stages its outputs there
        square_bytes = C * C * dtype.width // 8
        region_bytes = max(2 * square_bytes + NQ * C * dtype.width // 8, 4 * STAGING_WORDS)
        region = allocator.allocate_tensor(Float32, cute.make_layout(region_bytes // 4), 1024)
        s["ta"] = _mma.wgmma_tile_at(region, 0, dtype, C, C)
        s["tb"] = _mma.wgmma_tile_at(region, square_bytes, dtype, C, C)
        s["p"] = _mma.wgmma_tile_at(region, 2 * square_bytes, dtype, NQ, C)
        s_stage0 = allocator.allocate_tensor(Float32, cute.make_layout(STAGING_WORDS), 16)
        s_sc = allocator.allocate_tensor(Float32, cute.make_layout((4, C), stride=(C, 1)), 16)
        s_red = allocator.allocate_tensor(Float32, cute.make_layout((self.threads // 32, C), stride=(C, 1)), 16)

        if chunk < num_chunks[0]:
            first, steps = chunk_first_step[chunk], chunk_steps[chunk]
            self.load(g2s, tidx, chunk, head, k, v, q, do, ta, tb, p, scalars, chunk_states, chunk_grads, first,
                      steps, s, s_sc, NH, chunk_common.contained_flags(self, state_bad, read_bad, any_flagged))
            self.values_phase(tidx, s, s_sc, s_red, s_stage0, s2g_values, s2r_keys, dv, d_scalars, chunk, head, first,
                              steps)
            warpgroup = tidx // WARPGROUP
            local = tidx % WARPGROUP
            if warpgroup == 0:
                self.dp_and_dk(local, s, s_sc, s_stage0, s2g_square, d_p, dk_scan, chunk, head, first, steps)
            else:
                self.squares_and_queries(tidx, local, s, s_sc, s_red, region, s2g_square, d_tb, d_ta, dq_scan,
                                         d_scalars, chunk, head, first, steps, NH)

    @cute.jit
    def load(self, g2s, tidx, chunk, head, k, v, q, do, ta, tb, p, scalars, chunk_states, chunk_grads, first, steps,
             s, s_sc, num_householder, token_flags=None):
        """Load the chunk's tiles, its start state and end gradient (cp.async, rows past the chunk zero);
        contained (token flags given), zero the k and v rows of state_bad tokens and the q and dO rows of read_bad
        ones (a poisoned output passes no gradient)."""
        K, V, NQ = self.key_dim, self.value_dim, self.query_tile
        first_token = first // num_householder
        tokens = steps // num_householder
        def step_rows(x, cols):
            return cute.local_tile(cute.domain_offset((first, 0), x[None, head, None]), (C, cols), (0, 0))

        def token_rows(x, cols):
            return cute.local_tile(cute.domain_offset((first_token, 0), x[None, head, None]), (NQ, cols), (0, 0))

        _mma.copy_rows_g2s(g2s, tidx, step_rows(k, K), s["k"], steps)
        _mma.copy_rows_g2s(g2s, tidx, step_rows(v, V), s["v"], steps)
        _mma.copy_rows_g2s(g2s, tidx, ta[chunk, head, None, None], s["ta"], C)
        _mma.copy_rows_g2s(g2s, tidx, tb[chunk, head, None, None], s["tb"], C)
        _mma.copy_rows_g2s(g2s, tidx, chunk_states[chunk, head, None, None], s["x"], V)
        _mma.copy_rows_g2s(g2s, tidx, chunk_grads[chunk, head, None, None], s["dx"], V)
        _mma.copy_rows_g2s(g2s, tidx, token_rows(q, K), s["q"], tokens)
        _mma.copy_rows_g2s(g2s, tidx, token_rows(do, V), s["do"], tokens)
        _mma.copy_rows_g2s(g2s, tidx, p[chunk, head, None, None], s["p"], NQ)
        cute.arch.cp_async_commit_group()
        for i in cutlass.range_constexpr(4 * C // self.threads):
            index = tidx + i * self.threads
            s_sc[index // C, index % C] = scalars[chunk, head, index // C, index % C]
        cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(token_flags is not None):
            chunk_common.zero_flagged_chunk_rows(g2s, tidx, token_flags, head, first_token, steps, num_householder, K,
                                                 NQ, s["k"], s["v"], s["q"], s["do"])
        cute.arch.fence_view_async_shared()  # cp.async data -> the tensor cores' (async proxy) reads
        cute.arch.sync_threads()

    def _transposed(self, tile: cute.Tensor, rows: int, cols: int) -> cute.Tensor:
        return _mma.wgmma_transposed(tile, self.dtype, rows, cols)

    @cute.jit
    def values_phase(self, tidx, s, s_sc, s_red, s_stage0, s2g_values, s2r_keys, dv, d_scalars, chunk, head, first,
                     steps):
        """Rows = value rows (both warpgroups): D (recomputed), M1, dD, dv, Z, the reductions db and dd,
        and D, dD, -Z rounded into shared memory for the steps phase."""
        V, NQ, dtype = self.value_dim, self.query_tile, self.dtype
        smem_a = _mma.make_wgmma(dtype, 2, C, a_from_smem=True)  # Y = X k^T, M1 = dX k^T
        smem_at = _mma.make_wgmma(dtype, 2, C, a_from_smem=True, a_mn_major=True)  # D = v^T Tb^T
        smem_at_bt = _mma.make_wgmma(dtype, 2, C, a_from_smem=True, a_mn_major=True, b_mn_major=True)  # dO^T P
        regs_a = _mma.make_wgmma(dtype, 2, C)  # D -= Y Ta^T
        regs_a_bt = _mma.make_wgmma(dtype, 2, C, b_mn_major=True)  # dv^T = dD Tb, Z = dD Ta
        thr_a, thr_at, thr_at_bt = smem_a.get_slice(tidx), smem_at.get_slice(tidx), smem_at_bt.get_slice(tidx)
        thr_r, thr_r_bt = regs_a.get_slice(tidx), regs_a_bt.get_slice(tidx)
        coords = thr_a.partition_C(cute.make_identity_tensor((V, C)))  # the C layout depends on N only

        y = _accumulator(thr_a, V, C)
        _mma.wgmma(smem_a, y, _mma.wgmma_operand(thr_a, s["x"], "A"), _mma.wgmma_operand(thr_a, s["k"], "B"), False)
        d_acc = _accumulator(thr_a, V, C)
        _mma.wgmma(smem_at, d_acc, _mma.wgmma_operand(thr_at, self._transposed(s["v"], C, V), "A"),
                   _mma.wgmma_operand(thr_at, s["tb"], "B"), False)
        _mma.wgmma(regs_a, d_acc, _mma.accumulator_as_wgmma_a(_mma.scaled(y, -1.0), regs_a, dtype),
                   _mma.wgmma_operand(thr_r, s["ta"], "B"), True)
        # M1 = dX k^T; db = colsum(D * M1) (into Y's registers: Y is consumed)
        m1 = _accumulator(thr_a, V, C)
        _mma.wgmma(smem_a, m1, _mma.wgmma_operand(thr_a, s["dx"], "A"), _mma.wgmma_operand(thr_a, s["k"], "B"), False)
        for e in cutlass.range_constexpr(cute.size(m1)):
            y[e] = d_acc[e] * m1[e]
            m1[e] = m1[e] * s_sc[0, coords[e][1]]
        column_sums(y, coords, s_red, tidx)
        _mma.stage_accumulator(d_acc, coords, s["d"])
        # dD = M1 diag(b) + dO^T P, then dv^T = dD Tb (staged transposed) and Z = dD Ta
        _mma.wgmma(smem_at_bt, m1, _mma.wgmma_operand(thr_at_bt, self._transposed(s["do"], NQ, V), "A"),
                   _mma.wgmma_operand(thr_at_bt, self._transposed(s["p"], NQ, C), "B"), True)
        _mma.stage_accumulator(m1, coords, s["dd"])
        dd_a = _mma.accumulator_as_wgmma_a(m1, regs_a_bt, dtype)
        dv_t = _accumulator(thr_a, V, C)
        _mma.wgmma(regs_a_bt, dv_t, dd_a, _mma.wgmma_operand(thr_r_bt, self._transposed(s["tb"], C, C), "B"), False)
        _mma.stage_accumulator(dv_t, coords, _mma.staging_view(s_stage0, dtype, C, V, transpose=True))
        z = _accumulator(thr_a, V, C)
        _mma.wgmma(regs_a_bt, z, dd_a, _mma.wgmma_operand(thr_r_bt, self._transposed(s["ta"], C, C), "B"), False)
        _mma.stage_accumulator(_mma.scaled(z, -1.0), coords, s["z"])
        # dd = sum(X * dX) over the stored (rounded) tiles, read as 16-byte vectors (the swizzle keeps them whole)
        thr_rows = s2r_keys.get_slice(tidx)
        x_part, dx_part = thr_rows.partition_S(s["x"]), thr_rows.partition_S(s["dx"])
        x_regs, dx_regs = cute.make_fragment_like(x_part), cute.make_fragment_like(dx_part)
        cute.copy(s2r_keys, x_part, x_regs)
        cute.copy(s2r_keys, dx_part, dx_regs)
        products = x_regs.load().to(Float32) * dx_regs.load().to(Float32)
        partial = products.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        partial = cute.arch.warp_reduction_sum(partial)
        cute.arch.fence_view_async_shared()  # D, dD, -Z written by threads -> the steps phase's MMAs
        cute.arch.sync_threads()  # db partials, the staged dv and the rounded tiles are complete
        g_dv = cute.local_tile(cute.domain_offset((first, 0), dv[None, head, None]), (C, V), (0, 0))
        _mma.copy_rows_s2g(s2g_values, tidx, _mma.staging_view(s_stage0, dtype, C, V), g_dv, steps)
        if tidx < C:
            total = Float32(0.0)
            for w in cutlass.range_constexpr(self.threads // 32):
                total = total + s_red[w, tidx]
            d_scalars[chunk, head, 0, tidx] = total
        cute.arch.sync_threads()
        if tidx % 32 == 0:
            s_red[tidx // 32, 0] = partial
        cute.arch.sync_threads()
        if tidx == 0:
            total = Float32(0.0)
            for w in cutlass.range_constexpr(self.threads // 32):
                total = total + s_red[w, 0]
            d_scalars[chunk, head, 2, 0] = total
        cute.arch.sync_threads()  # s_red and the dv staging are free again

    @cute.jit
    def dp_and_dk(self, local, s, s_sc, s_stage, s2g_square, d_p, dk_scan, chunk, head, first, steps):
        """Warpgroup 0: dP^T = D^T dO^T and the scan's dk = diag(b) D^T dX - Z^T X (rows = steps)."""
        K, V, NQ, dtype = self.key_dim, self.value_dim, self.query_tile, self.dtype
        sync = lambda: cute.arch.barrier(barrier_id=1, number_of_threads=WARPGROUP)  # noqa: E731
        d_t = self._transposed(s["d"], V, C)
        by_token_mma = _mma.make_wgmma(dtype, 1, NQ, a_from_smem=True, a_mn_major=True)
        thr = by_token_mma.get_slice(local)
        dp_t = _accumulator(thr, C, NQ)
        _mma.wgmma(by_token_mma, dp_t, _mma.wgmma_operand(thr, d_t, "A"), _mma.wgmma_operand(thr, s["do"], "B"), False)
        _mma.stage_accumulator(dp_t, thr.partition_C(cute.make_identity_tensor((C, NQ))),
                               _mma.staging_view(s_stage, Float32, NQ, C, transpose=True))
        sync()
        _mma.copy_tile_s2g(s2g_square, local, _mma.staging_view(s_stage, Float32, NQ, C), d_p[chunk, head, None, None])
        by_key_mma = _mma.make_wgmma(dtype, 1, K, a_from_smem=True, a_mn_major=True, b_mn_major=True)
        thr = by_key_mma.get_slice(local)
        by_key = thr.partition_C(cute.make_identity_tensor((C, K)))
        dk = _accumulator(thr, C, K)
        _mma.wgmma(by_key_mma, dk, _mma.wgmma_operand(thr, d_t, "A"),
                   _mma.wgmma_operand(thr, self._transposed(s["dx"], V, K), "B"), False)
        for e in cutlass.range_constexpr(cute.size(dk)):
            dk[e] = dk[e] * s_sc[0, by_key[e][0]]
        _mma.wgmma(by_key_mma, dk, _mma.wgmma_operand(thr, self._transposed(s["z"], V, C), "A"),  # the tile holds -Z
                   _mma.wgmma_operand(thr, self._transposed(s["x"], V, K), "B"), True)
        g_dk = cute.local_tile(cute.domain_offset((first, 0), dk_scan[None, head, None]), (C, K), (0, 0))
        staged = _mma.staging_view(s_stage, Float32, C, C)
        for half in cutlass.range_constexpr(K // C):
            sync()  # the previous output has left the staging tile
            _mma.stage_accumulator(dk, by_key, staged, None, None, half * C)
            sync()
            _mma.copy_rows_s2g(s2g_square, local, staged, cute.local_tile(g_dk, (C, C), (0, half)), steps)

    @cute.jit
    def squares_and_queries(self, tidx, local, s, s_sc, s_red, s_stage, s2g_square, d_tb, d_ta, dq_scan, d_scalars,
                            chunk, head, first, steps, num_householder):
        """Warpgroup 1: dTb = dD^T v^T, dTa = -(dD^T X) k^T, and R^T = X^T dO^T for the scan's dq and dc."""
        K, V, NQ, dtype = self.key_dim, self.value_dim, self.query_tile, self.dtype
        sync = lambda: cute.arch.barrier(barrier_id=2, number_of_threads=WARPGROUP)  # noqa: E731
        dd_t = self._transposed(s["dd"], V, C)
        x_t = self._transposed(s["x"], V, K)
        staged_square = _mma.staging_view(s_stage, Float32, C, C)
        square_mma = _mma.make_wgmma(dtype, 1, C, a_from_smem=True, a_mn_major=True)
        thr = square_mma.get_slice(local)
        square = thr.partition_C(cute.make_identity_tensor((C, C)))
        acc = _accumulator(thr, C, C)
        _mma.wgmma(square_mma, acc, _mma.wgmma_operand(thr, dd_t, "A"), _mma.wgmma_operand(thr, s["v"], "B"), False)
        _mma.stage_accumulator(acc, square, staged_square)
        sync()
        _mma.copy_tile_s2g(s2g_square, local, staged_square, d_tb[chunk, head, None, None])
        # dTa = -rnd(dD^T X) k^T
        w_mma = _mma.make_wgmma(dtype, 1, K, a_from_smem=True, a_mn_major=True, b_mn_major=True)
        w_thr = w_mma.get_slice(local)
        w = _accumulator(w_thr, C, K)
        _mma.wgmma(w_mma, w, _mma.wgmma_operand(w_thr, dd_t, "A"), _mma.wgmma_operand(w_thr, x_t, "B"), False)
        ta_mma = _mma.make_wgmma(dtype, 1, C)
        ta_thr = ta_mma.get_slice(local)
        _mma.wgmma(ta_mma, acc, _mma.accumulator_as_wgmma_a(_mma.scaled(w, -1.0), ta_mma, dtype),
                   _mma.wgmma_operand(ta_thr, s["k"], "B"), False)
        sync()  # dTb has left the staging tile
        _mma.stage_accumulator(acc, square, staged_square)
        sync()
        _mma.copy_tile_s2g(s2g_square, local, staged_square, d_ta[chunk, head, None, None])
        # R^T = X^T dO^T [K, NQ]: dq (scan part) = c_t R[t, :], dc_t = R[t, :] . q_t
        r_mma = _mma.make_wgmma(dtype, 1, NQ, a_from_smem=True, a_mn_major=True)
        r_thr = r_mma.get_slice(local)
        key_token = r_thr.partition_C(cute.make_identity_tensor((K, NQ)))
        r_t = _accumulator(r_thr, K, NQ)
        _mma.wgmma(r_mma, r_t, _mma.wgmma_operand(r_thr, x_t, "A"), _mma.wgmma_operand(r_thr, s["do"], "B"), False)
        partial = cute.make_fragment_like(r_t, Float32)
        for e in cutlass.range_constexpr(cute.size(r_t)):
            c, t = key_token[e]
            partial[e] = r_t[e] * s["q"][t, c].to(Float32)
        column_sums(partial, key_token, s_red, tidx)  # rows 4-7 of s_red: this warpgroup's warps
        first_token = first // num_householder
        tokens = steps // num_householder
        g_dq = cute.local_tile(cute.domain_offset((first_token, 0), dq_scan[None, head, None]), (NQ, K), (0, 0))
        staged_dq = _mma.staging_view(s_stage, Float32, NQ, C)
        for half in cutlass.range_constexpr(K // C):
            sync()  # dTa (or the previous half) has left the staging tile
            _mma.stage_accumulator(r_t, key_token, _mma.staging_view(s_stage, Float32, NQ, C, transpose=True),
                                   s_sc[1, None], half * C)
            sync()
            _mma.copy_rows_s2g(s2g_square, local, staged_dq, cute.local_tile(g_dq, (NQ, C), (0, half)), tokens)
        if local < NQ:
            total = Float32(0.0)
            for w_index in cutlass.range_constexpr(4, 8):
                total = total + s_red[w_index, local]
            d_scalars[chunk, head, 1, local] = total
