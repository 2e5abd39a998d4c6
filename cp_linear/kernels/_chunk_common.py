"""Per-chunk device phases shared by ``chunk_prep`` and ``chunk_prep_backward`` (4 warps, 128 threads).

Each is a ``cute.jit`` function over shared-memory tiles of one chunk (C = 64 steps, whole tokens):

* ``load_chunk_inputs``: k and q tiles (cp.async, zero rows past the chunk), step gates and betas;
* ``gate_cumsum``: the inclusive cumulative gate G inside the chunk (warp 0);
* ``row_norms``: f = 1/||k_i|| and fq = 1/||q_t|| (1 without l2norm; 0 past the chunk);
* ``solve_unit_lower``: X = (I + A)^-1 for a strictly lower float32 A, one thread per column.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cp_linear.kernels import _mma
from cp_linear.kernels._common import L2NORM_EPS, zero_unless
from cp_linear.kernels.configs import CHUNK_SIZE

C = CHUNK_SIZE
SOLVE_BLOCK = 16


@cute.jit
def load_chunk_inputs(g2s, tidx, q: cute.Tensor, k: cute.Tensor, g: cute.Tensor, beta: cute.Tensor, head,
                      first, steps, num_householder, s_k: cute.Tensor, s_q: cute.Tensor, s_gate: cute.Tensor,
                      s_beta: cute.Tensor, key_dim: cutlass.Constexpr):
    """k rows [first, first + steps) and the chunk's q rows into shared memory (waits for them); step
    gates (a token's gate on its first step) and betas, zero past the chunk."""
    first_token = first // num_householder
    tokens = steps // num_householder
    g_k = cute.local_tile(cute.domain_offset((first, 0), k[None, head, None]), (C, key_dim), (0, 0))
    g_q = cute.local_tile(cute.domain_offset((first_token, 0), q[None, head, None]), (C, key_dim), (0, 0))
    _mma.copy_rows_g2s(g2s, tidx, g_k, s_k, steps)
    _mma.copy_rows_g2s(g2s, tidx, g_q, s_q, tokens)
    cute.arch.cp_async_commit_group()
    if tidx < C:
        step = first + cutlass.min(tidx, steps - 1)
        s_beta[tidx] = zero_unless(tidx < steps, beta[step, head])
        s_gate[tidx] = zero_unless((tidx < steps) & (tidx % num_householder == 0), g[step // num_householder, head])
    cute.arch.cp_async_wait_group(0)
    cute.arch.sync_threads()


@cute.jit
def gate_cumsum(tidx, s_gate: cute.Tensor):
    """s_gate <- its inclusive cumulative sum over the 64 steps (warp 0, two steps per lane)."""
    if tidx < 32:
        g0 = s_gate[2 * tidx]
        pair_total = g0 + s_gate[2 * tidx + 1]
        scan = pair_total
        for d in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(scan, 1 << d)
            if tidx >= (1 << d):
                scan = scan + up
        s_gate[2 * tidx] = scan - pair_total + g0
        s_gate[2 * tidx + 1] = scan


@cute.jit
def row_norms(tidx, s_k: cute.Tensor, s_q: cute.Tensor, s_f: cute.Tensor, s_fq: cute.Tensor, steps, tokens,
              use_l2: Int32, key_dim: cutlass.Constexpr):
    """Threads [0, 64) take the key rows, [64, 128) the query rows; 16-byte reads (the swizzle permutes
    whole 8-element groups, so a group stays contiguous)."""
    row = tidx % C
    sumsq = Float32(0.0)
    if tidx < C:
        for c8 in cutlass.range_constexpr(key_dim // 8):
            group = cute.local_tile(s_k, (1, 8), (row, c8)).load().to(Float32)
            for e in cutlass.range_constexpr(8):
                sumsq += group[e] * group[e]
    else:
        for c8 in cutlass.range_constexpr(key_dim // 8):
            group = cute.local_tile(s_q, (1, 8), (row, c8)).load().to(Float32)
            for e in cutlass.range_constexpr(8):
                sumsq += group[e] * group[e]
    norm = Float32(1.0)
    if use_l2 != 0:
        norm = cute.math.rsqrt(sumsq + Float32(L2NORM_EPS))
    if tidx < C:
        s_f[row] = zero_unless(row < steps, norm)
    else:
        s_fq[row] = zero_unless(row < tokens, norm)


@cute.jit
def solve_unit_lower(tidx, s_a: cute.Tensor, s_x: cute.Tensor):
    """s_x = (I + s_a)^-1 for a strictly lower s_a: threads [0, 64) own one column each and solve it
    16 rows at a time in registers (earlier blocks read back from s_x)."""
    if tidx < C:
        column = tidx
        x = cute.make_rmem_tensor(cute.make_layout((SOLVE_BLOCK,)), Float32)
        for block in cutlass.range_constexpr(C // SOLVE_BLOCK):
            base = block * SOLVE_BLOCK
            for r in cutlass.range_constexpr(SOLVE_BLOCK):
                x[r] = zero_unless(base + r == column, Float32(1.0))
            for l in range(base):
                earlier = s_x[l, column]
                for r in cutlass.range_constexpr(SOLVE_BLOCK):
                    x[r] -= s_a[base + r, l] * earlier
            for r in cutlass.range_constexpr(1, SOLVE_BLOCK):
                total = x[r]
                for jj in cutlass.range_constexpr(r):
                    total -= s_a[base + r, base + jj] * x[jj]
                x[r] = total
            for r in cutlass.range_constexpr(SOLVE_BLOCK):
                s_x[base + r, column] = x[r]
