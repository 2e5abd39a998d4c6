"""Containment of non-finite GDP inputs in one pass: per (token, head) flags and sanitised copies.

``cp_linear.validation`` draws the rule: a (token t, head h) is ``state_bad`` when a k row, v row or
beta entry of one of its n_h steps, or g[t, h], is non-finite, and ``read_bad`` when its q row is;
``torch_api.gdp.isolation`` poisons the outputs from these and feeds the kernels copies of q, k, v, g,
beta with every NaN / ±Inf replaced by 0. With ``TokenChecksConfig.copies`` False the kernel writes the
flags only: the contained chunk kernels (``configs.ChunkPrepConfig.contained`` and the others) read the
raw inputs and zero, as they load them, the k and v rows of every step of a state_bad token and the q row
of a read_bad token (``_mma.load_row_flags`` / ``zero_flagged_rows``), and read a non-finite g or beta
as 0. Their finite outputs equal the copies' (a zeroed row differs from its sanitised copy only where
everything it reaches is poisoned), so a clean input costs one read and no write (``jax_api.gdp.isolation``).

Work split (``TokenChecksLaunch`` views: q [R, K/8, 8], k / v [R·n_h, ·/8, 8], R = B·T·H)::

    CTA of 256 threads = 32 sub-warps of LANES = 8 lanes; sub-warp s owns (token, head) r = 32·block + s
    lane l loads vectors l, l + 8, ... of the q row r and of the k and v rows of each step j,
                 (token·n_h + j)·H + h, every load issued before any value is tested
    lane l < n_h also owns beta[token·n_h + l, h]; lane 0 owns g[token, h]

Neighbouring sub-warps own neighbouring heads, so a warp reads four whole neighbouring rows of each
input with each 16-byte load. A 16-bit value is non-finite when its exponent bits are all set
(bf16 0x7F80, fp16 0x7C00); each 32-bit word of a vector is tested and cleaned as two halves
(a cleared half is +0, as nan_to_num writes; everything else keeps its bits, -0 included). g and beta
are tested in float32 (x != x or |x| = inf). Each lane's two flags are ORed over its sub-warp with
three butterfly shuffles (no atomics, no shared memory); lane 0 stores them as bytes. Rows past R
(the last CTA) load the last row and store nothing.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Uint8, Uint32

from cp_linear.kernels._common import cutlass_dtype
from cp_linear.kernels.configs import TOKEN_CHECKS_LANES as LANES
from cp_linear.kernels.configs import TOKEN_CHECKS_THREADS as THREADS
from cp_linear.kernels.configs import TOKEN_CHECKS_VECTOR as VEC
from cp_linear.kernels.configs import TokenChecksConfig

TOKEN_HEADS = THREADS // LANES  # (token, head) pairs per CTA
EXPONENT_BITS = {"bfloat16": 0x7F80, "float16": 0x7C00}  # a 16-bit value is NaN / ±Inf when all are set
STATE_BIT, READ_BIT = 1, 2


@cute.jit
def _clean_words(values: cute.Tensor, exponent: cutlass.Constexpr) -> Boolean:
    """Zero every non-finite 16-bit value of the register tensor ``values`` in place; True if any was."""
    words = cute.recast_tensor(values, Uint32)
    low_mask, high_mask = exponent, exponent << 16
    bad = Boolean(False)
    for w in cutlass.range_constexpr(cute.size(words)):
        word = words[w]
        low_bad = (word & Uint32(low_mask)) == Uint32(low_mask)
        high_bad = (word & Uint32(high_mask)) == Uint32(high_mask)
        keep = cutlass.select_(low_bad, Uint32(0xFFFF0000), Uint32(0xFFFFFFFF)) & cutlass.select_(
            high_bad, Uint32(0x0000FFFF), Uint32(0xFFFFFFFF))
        words[w] = word & keep
        bad = bad | low_bad | high_bad
    return bad


@cute.jit
def _nonfinite(value: Float32) -> Boolean:
    return (value != value) | (cute.math.abs(value) == Float32(float("inf")))


class TokenChecksKernel:
    def __init__(self, config: TokenChecksConfig):
        config.validate()
        self.dtype = cutlass_dtype(config.dtype)
        self.exponent = EXPONENT_BITS[config.dtype]
        self.n_h = config.num_householder
        self.key_loads = config.key_vectors // LANES  # vectors per lane of a q or k row
        self.value_loads = config.value_vectors // LANES
        self.copies = config.copies

    @cute.jit
    def __call__(self,
                 q: cute.Tensor,  # [B·T·H, K/8, 8] input dtype
                 k: cute.Tensor,  # [B·T·n_h·H, K/8, 8] input dtype
                 v: cute.Tensor,  # [B·T·n_h·H, V/8, 8] input dtype
                 g: cute.Tensor,  # [B·T, H] float32
                 beta: cute.Tensor,  # [B·T·n_h, H] float32
                 state_bad: cute.Tensor,  # [B·T, H] uint8 (0 / 1)
                 read_bad: cute.Tensor,  # [B·T, H] uint8 (0 / 1)
                 q_out: cute.Tensor,  # as q
                 k_out: cute.Tensor,  # as k
                 v_out: cute.Tensor,  # as v
                 g_out: cute.Tensor,  # as g
                 beta_out: cute.Tensor,  # as beta
                 stream):
        blocks = (q.shape[0] + TOKEN_HEADS - 1) // TOKEN_HEADS
        self.kernel(q, k, v, g, beta, state_bad, read_bad, q_out, k_out, v_out, g_out, beta_out).launch(
            grid=(blocks, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
               state_bad: cute.Tensor, read_bad: cute.Tensor, q_out: cute.Tensor, k_out: cute.Tensor,
               v_out: cute.Tensor, g_out: cute.Tensor, beta_out: cute.Tensor):
        n_h = self.n_h
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        lane = tidx % LANES
        heads = g.shape[1]
        row = block * TOKEN_HEADS + tidx // LANES  # (token, head) = q row
        inside = row < q.shape[0]
        row = cutlass.min(row, q.shape[0] - 1)  # past the end: load the last row, store nothing
        token = row // heads
        head = row - token * heads
        first_step = token * n_h

        # every load first: q, then each step's k and v rows, beta and g
        q_regs = cute.make_rmem_tensor(cute.make_layout((self.key_loads, VEC), stride=(VEC, 1)), self.dtype)
        k_regs = cute.make_rmem_tensor(cute.make_layout((n_h * self.key_loads, VEC), stride=(VEC, 1)), self.dtype)
        v_regs = cute.make_rmem_tensor(cute.make_layout((n_h * self.value_loads, VEC), stride=(VEC, 1)), self.dtype)
        for i in cutlass.range_constexpr(self.key_loads):
            q_regs[i, None].store(q[row, lane + i * LANES, None].load())
        for j in cutlass.range_constexpr(n_h):
            step_row = (first_step + j) * heads + head
            for i in cutlass.range_constexpr(self.key_loads):
                k_regs[j * self.key_loads + i, None].store(k[step_row, lane + i * LANES, None].load())
            for i in cutlass.range_constexpr(self.value_loads):
                v_regs[j * self.value_loads + i, None].store(v[step_row, lane + i * LANES, None].load())
        beta_step = first_step + cutlass.min(lane, n_h - 1)  # lanes past n_h load the last step again
        beta_value = beta[beta_step, head]
        g_value = g[token, head]

        read = _clean_words(q_regs, self.exponent)
        state = _clean_words(k_regs, self.exponent) | _clean_words(v_regs, self.exponent)
        beta_bad, g_bad = _nonfinite(beta_value), _nonfinite(g_value)
        state = state | beta_bad | g_bad
        if cutlass.const_expr(self.copies):  # else flags only: the contained GDP kernels zero flagged rows
            if inside:
                for i in cutlass.range_constexpr(self.key_loads):
                    q_out[row, lane + i * LANES, None].store(q_regs[i, None].load())
                for j in cutlass.range_constexpr(n_h):
                    step_row = (first_step + j) * heads + head
                    for i in cutlass.range_constexpr(self.key_loads):
                        k_out[step_row, lane + i * LANES, None].store(k_regs[j * self.key_loads + i, None].load())
                    for i in cutlass.range_constexpr(self.value_loads):
                        v_out[step_row, lane + i * LANES, None].store(v_regs[j * self.value_loads + i, None].load())
                if lane < n_h:
                    beta_out[beta_step, head] = cutlass.select_(beta_bad, Float32(0.0), beta_value)
                if lane == 0:
                    g_out[token, head] = cutlass.select_(g_bad, Float32(0.0), g_value)

        # OR the flags over the sub-warp (every lane takes part in the shuffles)
        bits = cutlass.select_(state, Int32(STATE_BIT), Int32(0)) | cutlass.select_(read, Int32(READ_BIT), Int32(0))
        offset = 1
        while offset < LANES:
            bits = bits | cute.arch.shuffle_sync_bfly(bits, offset=offset)
            offset *= 2
        if inside & (lane == 0):
            state_bad[token, head] = Uint8(bits & STATE_BIT)
            read_bad[token, head] = Uint8((bits & READ_BIT) >> 1)
