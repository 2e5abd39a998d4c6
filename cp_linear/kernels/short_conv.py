"""The short causal depthwise convolution of the GDP layer, + SiLU, over packed documents.

Layouts are ``cp_linear.kernels.launch.ShortConvLaunch``'s: channels viewed as [C / 8, 8] so that a
thread owns one 16-byte vector of 8 channels; a batch row of L tokens is cut into P equal pieces, and
the W − 1 tokens before a piece come from ``halo`` (zeros, or a neighbour's tokens under CP).

Forward: grid (runs, channel blocks). A run is ``SHORT_CONV_TOKENS`` consecutive tokens of one piece;
a thread walks its run with the last W − 1 inputs in registers (each input loaded once, plus W − 1 at
the run's start) and writes

    pre[t] = bias + sum over taps j (oldest first) of w[j] · x[t − (W − 1 − j)]   (float32)
    y[t]   = pre[t] · sigmoid(pre[t])                                           (input dtype)

where tap j's input counts only when W − 1 − j <= positions[t] (same sequence), chosen by selection so
that a non-finite value in another sequence cannot leak in.

Backward: grid (runs, channel blocks) with runs of ``SHORT_CONV_BACKWARD_TOKENS`` tokens. A thread
recomputes pre and dpre = dy · silu'(pre) for its run and the W − 1 tokens after it (inside the piece),
keeps the last W dpre values in registers and emits dx[u] = sum_s w[W − 1 − s] · dpre[u + s] (tap s
usable at u + s) once dpre[u + W − 1] is known; the run at a piece's start also emits the halo's
gradient. The weight and bias gradients of the run's tokens are summed in registers and written as
one row of ``partials``; ``column_sum.ColumnSumKernel`` adds the rows in a fixed order, so the result does not depend on
the schedule (bitwise reproducible, and equal across frontends).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cp_linear.kernels._common import cutlass_dtype, zero_unless
from cp_linear.kernels.configs import SHORT_CONV_BACKWARD_TOKENS
from cp_linear.kernels.configs import SHORT_CONV_THREADS as THREADS
from cp_linear.kernels.configs import SHORT_CONV_TOKENS, SHORT_CONV_VECTOR as VEC
from cp_linear.kernels.configs import ShortConvConfig

LOAD_BATCH = 4  # tokens whose loads a thread issues together (several 16-byte loads in flight per thread)


def _grid(x: cute.Tensor, positions: cute.Tensor, pieces: Int32, run_tokens: int):
    """(runs of all pieces of all batch rows, channel blocks): runs on x, which has no 65535 limit."""
    length = positions.shape[0]
    piece = length // pieces
    runs = (piece + run_tokens - 1) // run_tokens
    return ((x.shape[0] // length) * pieces * runs, (x.shape[1] + THREADS - 1) // THREADS, 1)


def _thread_vector():
    """The channel vector (8 channels) this thread owns: blockIdx.y picks a block of THREADS vectors."""
    tidx, _, _ = cute.arch.thread_idx()
    _, channel_block, _ = cute.arch.block_idx()
    return channel_block * THREADS + tidx


class _Run:
    """Where a CTA's run lies: batch row ``row_piece // pieces``, piece ``row_piece % pieces``, tokens
    [first, last) of the batch row (inside [piece_start, piece_end)); x's row of token t is base + t."""

    def __init__(self, run_id, pieces, length, run_tokens: int):
        piece = length // pieces
        runs = (piece + run_tokens - 1) // run_tokens
        self.row_piece = run_id // runs
        batch_row = self.row_piece // pieces
        self.piece_start = (self.row_piece - batch_row * pieces) * piece
        self.piece_end = self.piece_start + piece
        self.first = self.piece_start + (run_id - self.row_piece * runs) * run_tokens
        self.last = cutlass.min(self.first + run_tokens, self.piece_end)
        self.base = batch_row * length


def _load_vector(source: cute.Tensor, row, vector, out: cute.Tensor, slot: int):
    """out[slot, :] = source[row, vector, :] in float32 (one 16-byte load)."""
    out[slot, None].store(source[row, vector, None].load().to(Float32))


def _load_before_piece(x: cute.Tensor, halo: cute.Tensor, run: _Run, token, vector, out: cute.Tensor,
                       slot: int, width: int):
    """out[slot, :] = token's inputs, from x inside the piece and from the halo before it. Both loads use
    valid (clamped) rows and one is selected: no branch around a load."""
    inside = cute.make_rmem_tensor(cute.make_layout((1, VEC)), Float32)
    before = cute.make_rmem_tensor(cute.make_layout((1, VEC)), Float32)
    _load_vector(x, run.base + cutlass.max(token, run.piece_start), vector, inside, 0)
    halo_row = run.row_piece * (width - 1) + cutlass.max(token - run.piece_start + (width - 1), 0)
    _load_vector(halo, cutlass.min(halo_row, run.row_piece * (width - 1) + width - 2), vector, before, 0)
    for e in range(VEC):
        out[slot, e] = cutlass.select_(token >= run.piece_start, inside[0, e], before[0, e])


def _pre_activation(window: cute.Tensor, weight: cute.Tensor, bias: cute.Tensor, position, e: int,
                    width: int):
    """bias + taps oldest first; window[j] is token t − (W − 1 − j), usable when W − 1 − j <= position."""
    pre = bias[e]
    for j in range(width):
        usable = position >= width - 1 - j
        pre = pre + weight[j, e] * zero_unless(usable, window[j, e])
    return pre


def _sigmoid(value: Float32) -> Float32:
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-value, fastmath=True))


def _run_registers(x: cute.Tensor, halo: cute.Tensor, weight: cute.Tensor, bias: cute.Tensor, run: _Run, vector,
                   width: int):
    """(taps [W, 8], bias [8], window [W, 8]) of a thread's run: window slot j holds token t − (W − 1 − j)
    of the current token t; slots 0 .. W − 2 start as the W − 1 inputs before the run's first token."""
    w_regs = cute.make_rmem_tensor(cute.make_layout((width, VEC), stride=(VEC, 1)), Float32)
    b_regs = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
    for j in range(width):
        w_regs[j, None].store(weight[j, vector, None].load())
    b_regs.store(bias[vector, None].load())
    window = cute.make_rmem_tensor(cute.make_layout((width, VEC), stride=(VEC, 1)), Float32)
    for j in range(width - 1):
        _load_before_piece(x, halo, run, run.first - (width - 1) + j, vector, window, j, width)
    return w_regs, b_regs, window


class _ShortConvBase:
    def __init__(self, config: ShortConvConfig):
        config.validate()
        self.width = config.width
        self.dtype = cutlass_dtype(config.dtype)


class ShortConvKernel(_ShortConvBase):
    @cute.jit
    def __call__(self,
                 x: cute.Tensor,  # [B·L, C/8, 8] input dtype
                 halo: cute.Tensor,  # [B·P·(W−1), C/8, 8] input dtype
                 weight: cute.Tensor,  # [W, C/8, 8] float32
                 bias: cute.Tensor,  # [C/8, 8] float32
                 positions: cute.Tensor,  # int32 [L]
                 y: cute.Tensor,  # [B·L, C/8, 8] input dtype
                 pieces: Int32,
                 stream):
        self.kernel(x, halo, weight, bias, positions, y, pieces).launch(
            grid=_grid(x, positions, pieces, SHORT_CONV_TOKENS), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, halo: cute.Tensor, weight: cute.Tensor, bias: cute.Tensor, positions: cute.Tensor,
               y: cute.Tensor, pieces: Int32):
        W = self.width
        run_id, _, _ = cute.arch.block_idx()
        vector = _thread_vector()
        run = _Run(run_id, pieces, positions.shape[0], SHORT_CONV_TOKENS)
        if vector < x.shape[1]:
            w_regs, b_regs, window = _run_registers(x, halo, weight, bias, run, vector, W)
            out = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
            batch = cute.make_rmem_tensor(cute.make_layout((LOAD_BATCH, VEC), stride=(VEC, 1)), self.dtype)
            for first in cutlass.range(run.first, run.last, LOAD_BATCH):
                # LOAD_BATCH loads in flight before any is used (rows clamped into the run)
                for i in cutlass.range_constexpr(LOAD_BATCH):
                    batch[i, None].store(x[run.base + cutlass.min(first + i, run.last - 1), vector, None].load())
                for i in cutlass.range_constexpr(LOAD_BATCH):
                    t = cutlass.min(first + i, run.last - 1)
                    window[W - 1, None].store(batch[i, None].load().to(Float32))
                    position = positions[t]
                    for e in cutlass.range_constexpr(VEC):
                        pre = _pre_activation(window, w_regs, b_regs, position, e, W)
                        out[e] = pre * _sigmoid(pre)
                    if first + i < run.last:
                        y[run.base + t, vector, None].store(out.load().to(self.dtype))
                    for j in cutlass.range_constexpr(W - 1):
                        window[j, None].store(window[j + 1, None].load())


class ShortConvBackwardKernel(_ShortConvBase):  # config: ShortConvBackwardConfig
    @cute.jit
    def __call__(self,
                 x: cute.Tensor,  # [B·L, C/8, 8] input dtype
                 halo: cute.Tensor,  # [B·P·(W−1), C/8, 8] input dtype
                 weight: cute.Tensor,  # [W, C/8, 8] float32
                 bias: cute.Tensor,  # [C/8, 8] float32
                 positions: cute.Tensor,  # int32 [L]
                 dy: cute.Tensor,  # [B·L, C/8, 8] input dtype
                 dx: cute.Tensor,  # [B·L, C/8, 8] input dtype
                 dhalo: cute.Tensor,  # [B·P·(W−1), C/8, 8] input dtype
                 partials: cute.Tensor,  # [R, W + 1, C/8, 8] float32
                 pieces: Int32,
                 stream):
        self.kernel(x, halo, weight, bias, positions, dy, dx, dhalo, partials, pieces).launch(
            grid=_grid(x, positions, pieces, SHORT_CONV_BACKWARD_TOKENS), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, halo: cute.Tensor, weight: cute.Tensor, bias: cute.Tensor, positions: cute.Tensor,
               dy: cute.Tensor, dx: cute.Tensor, dhalo: cute.Tensor, partials: cute.Tensor, pieces: Int32):
        W = self.width
        run_id, _, _ = cute.arch.block_idx()
        vector = _thread_vector()
        run = _Run(run_id, pieces, positions.shape[0], SHORT_CONV_BACKWARD_TOKENS)
        if vector < x.shape[1]:
            w_regs, b_regs, window = _run_registers(x, halo, weight, bias, run, vector, W)
            # slot s holds token u + s (u = t − (W − 1)): its dpre and position; tokens before the run
            # start as dpre 0 (only the halo's gradient reads them), tokens past the piece get dpre 0
            dpre_window = cute.make_rmem_tensor(cute.make_layout((W, VEC), stride=(VEC, 1)), Float32)
            dpre_window.fill(0.0)
            position_window = cute.make_rmem_tensor(cute.make_layout((W,)), Int32)
            position_window.fill(0)
            grads = cute.make_rmem_tensor(cute.make_layout((W + 1, VEC), stride=(VEC, 1)), Float32)
            grads.fill(0.0)
            dy_regs = cute.make_rmem_tensor(cute.make_layout((1, VEC)), Float32)
            dx_regs = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
            # tokens whose dx this run writes: its own, and at a piece's start the halo's W − 1 before it
            emit_first = cutlass.select_(run.first == run.piece_start, run.first - (W - 1), run.first)
            x_batch = cute.make_rmem_tensor(cute.make_layout((LOAD_BATCH, VEC), stride=(VEC, 1)), self.dtype)
            dy_batch = cute.make_rmem_tensor(cute.make_layout((LOAD_BATCH, VEC), stride=(VEC, 1)), self.dtype)
            for first in cutlass.range(run.first, run.last + W - 1, LOAD_BATCH):
                for i in cutlass.range_constexpr(LOAD_BATCH):
                    # a valid row; its values are unused past the piece
                    row = run.base + cutlass.min(first + i, run.piece_end - 1)
                    x_batch[i, None].store(x[row, vector, None].load())
                    dy_batch[i, None].store(dy[row, vector, None].load())
                for i in cutlass.range_constexpr(LOAD_BATCH):
                    t = first + i
                    inside = t < run.piece_end
                    clamped = cutlass.min(t, run.piece_end - 1)
                    window[W - 1, None].store(x_batch[i, None].load().to(Float32))
                    dy_regs[0, None].store(dy_batch[i, None].load().to(Float32))
                    position = positions[clamped]
                    for s in cutlass.range_constexpr(W - 1):
                        dpre_window[s, None].store(dpre_window[s + 1, None].load())
                        position_window[s] = position_window[s + 1]
                    position_window[W - 1] = position
                    for e in cutlass.range_constexpr(VEC):
                        pre = _pre_activation(window, w_regs, b_regs, position, e, W)
                        sig = _sigmoid(pre)
                        dpre = dy_regs[0, e] * sig * (Float32(1.0) + pre * (Float32(1.0) - sig))
                        dpre_window[W - 1, e] = zero_unless(inside, dpre)
                    if t < run.last:  # the run's own tokens feed its weight and bias gradients
                        for e in cutlass.range_constexpr(VEC):
                            dpre = dpre_window[W - 1, e]
                            for j in cutlass.range_constexpr(W):
                                tap_input = zero_unless(position >= W - 1 - j, window[j, e])
                                grads[j, e] = grads[j, e] + dpre * tap_input
                            grads[W, e] = grads[W, e] + dpre
                    u = t - (W - 1)
                    if (u >= emit_first) & (u < run.last):  # past the run: the next run writes it
                        for e in cutlass.range_constexpr(VEC):
                            total = Float32(0.0)
                            for s in cutlass.range_constexpr(W):
                                reaches = position_window[s] >= s  # tap s of token u + s reads token u
                                total = total + w_regs[W - 1 - s, e] * zero_unless(reaches, dpre_window[s, e])
                            dx_regs[e] = total
                        if u >= run.piece_start:
                            dx[run.base + u, vector, None].store(dx_regs.load().to(self.dtype))
                        else:
                            dhalo[run.row_piece * (W - 1) + u - run.piece_start + (W - 1), vector, None].store(
                                dx_regs.load().to(self.dtype))
                    for j in cutlass.range_constexpr(W - 1):
                        window[j, None].store(window[j + 1, None].load())
            for j in cutlass.range_constexpr(W + 1):
                partials[run_id, j, vector, None].store(grads[j, None].load())
