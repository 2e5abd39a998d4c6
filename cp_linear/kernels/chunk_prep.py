"""Per-chunk preparation on tensor cores: everything a chunk needs that does not depend on the state.

One CTA of 4 warps per (chunk, head); chunks are independent, so this kernel fills the GPU at any
batch size. For a chunk of C <= 64 steps (whole tokens; see ``emulation.py`` for the notation):

* Gram = k k^T and QK = q k^T on one warpgroup MMA each (float32 accumulation; the tensor cores read
  the k and q tiles once, where ``mma.sync`` had every warp load k through ldmatrix);
* A[i, j] = beta_i f_i f_j exp(G_i - G_j) Gram[i, j] (j < i) and T = (I + A)^-1 in float32,
  blocked (16 x 16 diagonal blocks by substitution, merged 16 -> 32 -> 64 by products);
* written for the scan: Ta = T diag(exp(G) f beta) and Tb = T diag(beta) (input dtype,
  [64, 64]), P[t, j] = scale fq_t f_j exp(G_{i_t} - G_j) QK[t, j] for j <= i_t (input dtype,
  [NQ, 64]), and float32 scalars [4, 64]: row 0 b_j = f_j exp(G_last - G_j), row 1
  c_t = scale exp(G_{i_t}) fq_t, row 2 exp(G_last) (every column), row 3 unused.

Padded steps (past the chunk's length) get beta = f = 0, so they contribute nothing downstream.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cp_linear.kernels import _chunk_common as chunk_common
from cp_linear.kernels import _mma
from cp_linear.kernels._common import cutlass_dtype, smem_vector
from cp_linear.kernels.configs import CHUNK_SIZE, ChunkPrepConfig

C = CHUNK_SIZE
WARPS = 4
THREADS = 32 * WARPS
A_PITCH = C + 4  # float32 rows of the A / T tiles: 16-byte aligned, conflict-free column reads


class ChunkPrepKernel:
    def __init__(self, config: ChunkPrepConfig):
        config.validate()
        self.dtype = cutlass_dtype(config.dtype)
        self.key_dim = config.key_dim
        self.query_tile = config.query_tile
        self.contained = config.contained

    @cute.jit
    def __call__(self,
                 q: cute.Tensor,  # [T_all, H, K] input dtype
                 k: cute.Tensor,  # [S_all, H, K] input dtype
                 g: cute.Tensor,  # [T_all, H] float32
                 beta: cute.Tensor,  # [S_all, H] float32
                 chunk_first_step: cute.Tensor,  # int32 [C_max]
                 chunk_steps: cute.Tensor,  # int32 [C_max]
                 num_chunks: cute.Tensor,  # int32 [1]
                 state_bad: cute.Tensor,  # [T_all, H] uint8 (read when contained)
                 read_bad: cute.Tensor,  # [T_all, H] uint8 (read when contained)
                 any_flagged: cute.Tensor,  # int32 [1]: nonzero when any token is flagged (contained)
                 ta: cute.Tensor,  # [C_max, H, 64, 64] input dtype (out)
                 tb: cute.Tensor,  # [C_max, H, 64, 64] input dtype (out)
                 p: cute.Tensor,  # [C_max, H, NQ, 64] input dtype (out)
                 scalars: cute.Tensor,  # [C_max, H, 4, 64] float32 (out)
                 scale: Float32, use_l2: Int32, num_householder: Int32, stream):
        g2s = _mma.make_g2s_copy(self.dtype, THREADS)
        self.kernel(q, k, g, beta, chunk_first_step, chunk_steps, num_chunks, state_bad, read_bad, any_flagged, ta,
                    tb, p,
                    scalars, scale, use_l2, num_householder, g2s).launch(
            grid=(chunk_first_step.shape[0], k.shape[1], 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
               chunk_first_step: cute.Tensor, chunk_steps: cute.Tensor, num_chunks: cute.Tensor,
               state_bad: cute.Tensor, read_bad: cute.Tensor, any_flagged: cute.Tensor, ta: cute.Tensor,
               tb: cute.Tensor, p: cute.Tensor,
               scalars: cute.Tensor,
               scale: Float32, use_l2: Int32, num_householder: Int32, g2s: cute.TiledCopy):
        K, NH, NQ = self.key_dim, num_householder, self.query_tile
        tidx, _, _ = cute.arch.thread_idx()
        chunk, head, _ = cute.arch.block_idx()
        allocator = cutlass.utils.SmemAllocator()
        # 1024-byte aligned: read by warpgroup MMAs (``_mma.as_wgmma_tile``)
        s_k = allocator.allocate_tensor(self.dtype, _mma.smem_tile_layout(C, K), 1024)
        s_q = allocator.allocate_tensor(self.dtype, _mma.smem_tile_layout(C, K), 1024)
        s_a = allocator.allocate_tensor(Float32, cute.make_layout((C, C), stride=(A_PITCH, 1)), 16)
        # T overlays the k and q tiles (dead once A and P are formed) where they are large enough:
        # 51 KB per CTA at K = 128, four CTAs per SM
        x_layout = cute.make_layout((C, C), stride=(A_PITCH, 1))
        if cutlass.const_expr(2 * C * K * self.dtype.width // 8 >= C * A_PITCH * 4):
            s_x = cute.make_tensor(cute.recast_ptr(s_k.iterator, dtype=Float32), x_layout)
        else:
            s_x = allocator.allocate_tensor(Float32, x_layout, 16)
        s_gate = smem_vector(allocator, C)
        s_beta = smem_vector(allocator, C)
        s_f = smem_vector(allocator, C)
        s_fq = smem_vector(allocator, C)
        s_ta_scale = smem_vector(allocator, C)

        if chunk < num_chunks[0]:
            first = chunk_first_step[chunk]
            steps = chunk_steps[chunk]
            tokens = steps // NH
            chunk_common.load_chunk_inputs(g2s, tidx, q, k, g, beta, head, first, steps, NH, s_k, s_q, s_gate,
                                           s_beta, K, chunk_common.contained_flags(self, state_bad, read_bad,
                                                                                   any_flagged))
            chunk_common.gate_cumsum(tidx, s_gate)
            chunk_common.row_norms(tidx, s_k, s_q, s_f, s_fq, steps, tokens, use_l2, K)
            cute.arch.fence_view_async_shared()  # cp.async data -> the warpgroup MMAs' reads
            cute.arch.sync_threads()

            by_key = _mma.make_wgmma(self.dtype, 1, C, a_from_smem=True)
            thr_mma = by_key.get_slice(tidx)
            coords = thr_mma.partition_C(cute.make_identity_tensor((C, C)))
            keys = _mma.as_wgmma_tile(s_k, self.dtype, C, K)
            k_as_b = _mma.wgmma_operand(thr_mma, keys, "B")

            # A = strictly lower beta_i f_i f_j exp(G_i - G_j) (k_i . k_j), float32 in shared memory.
            gram = thr_mma.make_fragment_C(thr_mma.partition_shape_C((C, C)))
            _mma.wgmma(by_key, gram, _mma.wgmma_operand(thr_mma, keys, "A"), k_as_b, False)
            for e in cutlass.range_constexpr(cute.size(gram)):
                i, j = coords[e]
                value = Float32(0.0)
                if j < i:
                    value = s_beta[i] * s_f[i] * s_f[j] * cute.math.exp(s_gate[i] - s_gate[j]) * gram[e]
                s_a[i, j] = value

            # P = scale fq_t f_j exp(G_{i_t} - G_j) (q_t . k_j) for j <= i_t (i_t: token t's last step).
            qk = thr_mma.make_fragment_C(thr_mma.partition_shape_C((C, C)))
            _mma.wgmma(by_key, qk, _mma.wgmma_operand(thr_mma, _mma.as_wgmma_tile(s_q, self.dtype, C, K), "A"), k_as_b,
                       False)
            for e in cutlass.range_constexpr(cute.size(qk)):
                t, j = coords[e]
                if t < NQ:
                    last = t * NH + NH - 1
                    value = Float32(0.0)
                    if (j <= last) & (t < tokens):
                        value = scale * s_fq[t] * s_f[j] * cute.math.exp(s_gate[last] - s_gate[j]) * qk[e]
                    p[chunk, head, t, j] = value.to(self.dtype)
            cute.arch.sync_threads()

            # T = (I + A)^-1 (blocked, every thread), then Ta and Tb written 8 columns (16 bytes) at a time
            if tidx < C:
                s_ta_scale[tidx] = s_beta[tidx] * s_f[tidx] * cute.math.exp(s_gate[tidx])
            chunk_common.invert_unit_lower(tidx, s_a, s_x)
            for it in cutlass.range_constexpr(C * C // 8 // THREADS):
                flat = tidx + it * THREADS
                row, group = flat // 8, flat % 8
                t_row = cute.local_tile(s_x[row, None], (8,), (group,)).load()
                a_scale = cute.local_tile(s_ta_scale, (8,), (group,)).load()
                b_scale = cute.local_tile(s_beta, (8,), (group,)).load()
                cute.local_tile(ta[chunk, head, row, None], (8,), (group,)).store((t_row * a_scale).to(self.dtype))
                cute.local_tile(tb[chunk, head, row, None], (8,), (group,)).store((t_row * b_scale).to(self.dtype))
            if tidx < C:
                column = tidx
                last_step = cutlass.max(steps - 1, 0)
                gate_last = s_gate[last_step]
                scalars[chunk, head, 0, column] = s_f[column] * cute.math.exp(gate_last - s_gate[column])
                token_scale = Float32(0.0)
                if column < tokens:
                    token_scale = scale * s_fq[column] * cute.math.exp(s_gate[column * NH + NH - 1])
                scalars[chunk, head, 1, column] = token_scale
                scalars[chunk, head, 2, column] = cute.math.exp(gate_last)
                scalars[chunk, head, 3, column] = Float32(0.0)
