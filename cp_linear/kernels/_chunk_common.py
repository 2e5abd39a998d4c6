"""Per-chunk device phases shared by ``chunk_prep`` and ``chunk_prep_backward`` (4 warps, 128 threads).

Each is a ``cute.jit`` function over shared-memory tiles of one chunk (C = 64 steps, whole tokens):

* ``load_chunk_inputs``: k and q tiles (cp.async, zero rows past the chunk), step gates and betas;
* ``gate_cumsum``: the inclusive cumulative gate G inside the chunk (warp 0);
* ``row_norms``: f = 1/||k_i|| and fq = 1/||q_t|| (1 without l2norm; 0 past the chunk);
* ``invert_unit_lower``: X = (I + A)^-1 for a strictly lower float32 A, blocked (16 -> 32 -> 64).
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
                      s_beta: cute.Tensor, key_dim: cutlass.Constexpr, token_flags=None):
    """k rows [first, first + steps) and the chunk's q rows into shared memory (waits for them); step
    gates (a token's gate on its first step) and betas, zero past the chunk.

    Contained inputs (``token_flags`` from ``contained_flags``): the k rows of a state_bad token and the q row
    of a read_bad token are zeroed (``zero_flagged_chunk_rows``), and a non-finite gate or beta reads 0
    (``cp_linear.kernels.token_checks``)."""
    first_token = first // num_householder
    tokens = steps // num_householder
    g_k = cute.local_tile(cute.domain_offset((first, 0), k[None, head, None]), (C, key_dim), (0, 0))
    g_q = cute.local_tile(cute.domain_offset((first_token, 0), q[None, head, None]), (C, key_dim), (0, 0))
    _mma.copy_rows_g2s(g2s, tidx, g_k, s_k, steps)
    _mma.copy_rows_g2s(g2s, tidx, g_q, s_q, tokens)
    cute.arch.cp_async_commit_group()
    contained = cutlass.const_expr(token_flags is not None)
    if tidx < C:
        step = first + cutlass.min(tidx, steps - 1)
        beta_value = beta[step, head]
        gate_value = g[step // num_householder, head]
        if cutlass.const_expr(contained):
            beta_value = zero_unless(finite(beta_value), beta_value)
            gate_value = zero_unless(finite(gate_value), gate_value)
        s_beta[tidx] = zero_unless(tidx < steps, beta_value)
        s_gate[tidx] = zero_unless((tidx < steps) & (tidx % num_householder == 0), gate_value)
    cute.arch.cp_async_wait_group(0)
    if cutlass.const_expr(contained):
        zero_flagged_chunk_rows(g2s, tidx, token_flags, head, first_token, steps, num_householder, key_dim, C, s_k,
                                s_q=s_q)
    cute.arch.sync_threads()


def contained_flags(kernel, state_bad: cute.Tensor, read_bad: cute.Tensor, any_flagged: cute.Tensor):
    """The ``token_flags`` of ``zero_flagged_chunk_rows`` for a kernel whose config is contained: (state_bad,
    read_bad, whether any token of the launch is flagged: ``any_flagged[0] != 0``, read where this is called);
    else None (the launch's flag arguments are placeholders it never reads)."""
    return (state_bad, read_bad, any_flagged[0] != 0) if kernel.contained else None


@cute.jit
def zero_flagged_chunk_rows(g2s, tidx, token_flags: tuple, head, first_token, steps, num_householder,
                            key_dim: cutlass.Constexpr, query_rows: cutlass.Constexpr, s_k: cute.Tensor, s_v=None,
                            s_q=None, s_do=None, s_read_bad=None):
    """Contained, after the chunk's copies' wait and before the barrier that publishes its tiles: zero this
    thread's vectors of the flagged rows, the k (and v) rows of every step of a state_bad token and the q (and
    dO) row of a read_bad token; ``s_read_bad`` (uint8 [query_rows], shared) gets the q rows' flags.
    ``token_flags`` = (state_bad, read_bad, flagged): ``flagged`` is the launch's ``any_flagged[0] != 0``.
    Without a flagged token anywhere (the common case) a chunk costs one uniform branch: the flags are loaded
    only then, after the wait (a round trip per chunk, on inputs that hold a non-finite value)."""
    state_bad, read_bad, flagged = token_flags
    if flagged:
        step_flags = _mma.row_flags_fragment(g2s, tidx, (C, key_dim))
        _mma.load_row_flags(g2s, tidx, (C, key_dim), head_flags(state_bad, first_token, head), steps,
                            num_householder, step_flags)
        _mma.zero_flagged_rows(g2s, tidx, s_k, step_flags)
        if cutlass.const_expr(s_v is not None):
            _mma.zero_flagged_rows(g2s, tidx, s_v, step_flags)
        if cutlass.const_expr(s_q is not None):
            q_flags = _mma.row_flags_fragment(g2s, tidx, (query_rows, key_dim))
            _mma.load_row_flags(g2s, tidx, (query_rows, key_dim), head_flags(read_bad, first_token, head),
                                steps // num_householder, 1, q_flags)
            _mma.zero_flagged_rows(g2s, tidx, s_q, q_flags)
            if cutlass.const_expr(s_do is not None):  # a poisoned output passes no gradient
                _mma.zero_flagged_rows(g2s, tidx, s_do, q_flags)
            if cutlass.const_expr(s_read_bad is not None):
                _mma.store_row_flags(g2s, tidx, (query_rows, key_dim), q_flags, s_read_bad)


def head_flags(flags: cute.Tensor, first_token, head) -> cute.Tensor:
    """One head's token flags (uint8 [T_all, H]) from ``first_token`` on, as a 1-D view."""
    return cute.domain_offset((first_token,), flags[None, head])


@cute.jit
def finite(value: Float32):
    return (value == value) & (cute.math.abs(value) != Float32(float("inf")))


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
              use_l2: Int32, key_dim: cutlass.Constexpr, threads: cutlass.Constexpr = 2 * C):
    """Threads [0, 64) take the key rows, [64, 128) the query rows (threads past 128 none); 16-byte reads
    (the swizzle permutes whole 8-element groups, so a group stays contiguous)."""
    if cutlass.const_expr(threads > 2 * C):
        if tidx < 2 * C:
            row_norms(tidx, s_k, s_q, s_f, s_fq, steps, tokens, use_l2, key_dim)
        return
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
def invert_unit_lower(tidx, s_a: cute.Tensor, s_x: cute.Tensor, threads: cutlass.Constexpr = 2 * C):
    """s_x = (I + s_a)^-1 for a strictly lower float32 s_a [64, 64], on 128 threads (of ``threads``: the
    others only meet the barriers; with 256, step 3 runs on all of them), blocked:

    1. the four 16 x 16 diagonal blocks by substitution (threads [0, 64), one column each; the
       others zero the upper 16 x 16 blocks (0, 1) and (2, 3));
    2. 16 -> 32: X_ij = -X_ii (A_ij X_jj) for the blocks (1, 0) and (3, 2) (64 threads each);
    3. 32 -> 64: X_10 = -X_11 (A_10 X_00) on the 32 x 32 blocks (128 or 256 threads).

    Every thread does about 600 multiply-adds, against 2000 for one column's substitution. The
    products A_ij X_jj live in the upper 32 x 32 block, which is zeroed at the end. Both tiles need
    rows of a multiple of 4 floats (16-byte vectors). Ends with a barrier.
    """
    working = True
    if cutlass.const_expr(threads > 2 * C):
        working = tidx < 2 * C
    if tidx < C:
        block = tidx // SOLVE_BLOCK
        column = tidx % SOLVE_BLOCK
        diag_a = cute.local_tile(s_a, (SOLVE_BLOCK, SOLVE_BLOCK), (block, block))
        diag_x = cute.local_tile(s_x, (SOLVE_BLOCK, SOLVE_BLOCK), (block, block))
        x = cute.make_rmem_tensor(cute.make_layout((SOLVE_BLOCK,)), Float32)
        for r in cutlass.range_constexpr(SOLVE_BLOCK):
            total = zero_unless(column == r, Float32(1.0))
            for m in cutlass.range_constexpr(r):
                total -= diag_a[r, m] * x[m]
            x[r] = total
        for r in cutlass.range_constexpr(SOLVE_BLOCK):
            diag_x[r, column] = x[r]
    elif working:
        for it in cutlass.range_constexpr(2):
            flat = tidx - C + it * C  # [0, 64): block (0, 1); [64, 128): block (2, 3)
            corner = cute.local_tile(s_x, (SOLVE_BLOCK, SOLVE_BLOCK), (2 * (flat // C), 2 * (flat // C) + 1))
            cute.local_tile(corner, (1, 4), ((flat % C) // 4, flat % 4)).fill(0.0)
    cute.arch.sync_threads()

    pair = tidx // 64  # the blocks (2 pair + 1, 2 pair); the product in scratch block (pair, 2 + pair)
    lane = tidx % 64
    product = cute.local_tile(s_x, (SOLVE_BLOCK, SOLVE_BLOCK), (pair % 2, 2 + pair % 2))
    if working:
        _block_product(lane, cute.local_tile(s_a, (SOLVE_BLOCK, SOLVE_BLOCK), (2 * pair + 1, 2 * pair)),
                       cute.local_tile(s_x, (SOLVE_BLOCK, SOLVE_BLOCK), (2 * pair, 2 * pair)), product,
                       SOLVE_BLOCK, SOLVE_BLOCK, SOLVE_BLOCK, 1, False)
    cute.arch.sync_threads()
    if working:
        _block_product(lane, cute.local_tile(s_x, (SOLVE_BLOCK, SOLVE_BLOCK), (2 * pair + 1, 2 * pair + 1)),
                       product, cute.local_tile(s_x, (SOLVE_BLOCK, SOLVE_BLOCK), (2 * pair + 1, 2 * pair)),
                       SOLVE_BLOCK, SOLVE_BLOCK, SOLVE_BLOCK, 1, True)
    cute.arch.sync_threads()

    half = C // 2
    scratch = cute.local_tile(s_x, (half, half), (0, 1))
    # step 3 on 128 threads, two rows of 4 columns each; given 256, on all of them, one row each
    rows_each = 1 if threads == 4 * C else 2
    step3_working = True if threads == 4 * C else working
    if step3_working:
        _block_product(tidx, cute.local_tile(s_a, (half, half), (1, 0)), cute.local_tile(s_x, (half, half), (0, 0)),
                       scratch, half, half, half, rows_each, False)
    cute.arch.sync_threads()
    if step3_working:
        _block_product(tidx, cute.local_tile(s_x, (half, half), (1, 1)), scratch,
                       cute.local_tile(s_x, (half, half), (1, 0)), half, half, half, rows_each, True)
    cute.arch.sync_threads()
    if step3_working:
        for it in cutlass.range_constexpr(rows_each):  # the upper 32 x 32 block back to zero: 256 float4
            flat = tidx + it * 128
            cute.local_tile(scratch, (1, 4), (flat // 8, flat % 8)).fill(0.0)
    cute.arch.sync_threads()


@cute.jit
def _block_product(lane, left: cute.Tensor, right: cute.Tensor, out: cute.Tensor, rows: cutlass.Constexpr,
                   cols: cutlass.Constexpr, inner: cutlass.Constexpr, rows_per_thread: cutlass.Constexpr,
                   negate: cutlass.Constexpr):
    """out = (-)left right for float32 tiles [rows, inner] x [inner, cols]: thread ``lane`` of
    rows * cols / (4 rows_per_thread) computes ``rows_per_thread`` rows (spaced rows / rows_per_thread
    apart) of 4 adjacent columns; a row of ``right`` is read as one 16-byte vector."""
    groups = cols // 4
    col_group = lane % groups
    first_row = lane // groups
    spacing = rows // rows_per_thread
    acc = cute.make_rmem_tensor(cute.make_layout((rows_per_thread, 4), stride=(4, 1)), Float32)
    acc.fill(0.0)
    for m in cutlass.range_constexpr(inner):
        b = cute.local_tile(right, (1, 4), (m, col_group)).load()
        for r in cutlass.range_constexpr(rows_per_thread):
            a = left[first_row + r * spacing, m]
            for c in cutlass.range_constexpr(4):
                acc[r, c] = acc[r, c] + a * b[c]
    for r in cutlass.range_constexpr(rows_per_thread):
        result = acc[r, None].load()
        if cutlass.const_expr(negate):
            result = -result
        cute.local_tile(out, (1, 4), (first_row + r * spacing, col_group)).store(result)
