"""The GDP layer's gated output norm: out = x · rsqrt(mean(x²) + eps) · weight · silu(gate), per row of D.

Layouts are ``cp_linear.kernels.launch.GatedRMSNormLaunch``'s: rows of D values viewed as [D / 8, 8],
so D / 8 consecutive lanes own one row (one 16-byte vector each) and add their partial sums of squares
with butterfly shuffles. A CTA takes ``GATED_NORM_FORWARD_ROWS`` (backward: ``GATED_NORM_ROWS``)
consecutive rows; its row groups walk them
interleaved (a warp reads whole neighbouring rows) with ``LOAD_BATCH`` rows' loads in flight at once.
All arithmetic is float32; outputs are rounded to the input dtype once.

Backward, with r = rsqrt(mean(x²) + eps), n = x · r, s = silu(gate), da = dout · s:
    dgate = dout · n · weight · silu'(gate),   dx = r · (da · weight − n · mean(da · weight · n)),
and the weight gradient's sum of da · n over the CTA's rows goes to one row of ``partials`` (row groups
added in order through shared memory); ``ColumnSumKernel`` adds the CTAs' rows in order.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cp_linear.kernels._common import cutlass_dtype
from cp_linear.kernels.configs import GATED_NORM_FORWARD_ROWS, GATED_NORM_ROWS, GATED_NORM_THREADS as THREADS
from cp_linear.kernels.configs import SHORT_CONV_VECTOR as VEC  # 16-byte vectors, as GatedRMSNormConfig.vector
from cp_linear.kernels.configs import GatedRMSNormConfig

LOAD_BATCH = 4  # rows per thread whose loads are issued together


def _row_sum(value: Float32, lanes: int) -> Float32:
    """Sum over the ``lanes`` consecutive lanes of one row (butterfly: every lane gets the total)."""
    offset = 1
    while offset < lanes:
        value = value + cute.arch.shuffle_sync_bfly(value, offset=offset)
        offset *= 2
    return value


def _silu_parts(gate: Float32):
    """(silu(gate), silu'(gate))."""
    sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-gate, fastmath=True))
    return gate * sig, sig * (Float32(1.0) + gate * (Float32(1.0) - sig))


class _Rows:
    """This thread's place: lane ``vector`` of row group ``group``; the CTA's rows start at ``first``."""

    def __init__(self, dim: int, rows_per_cta: int):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        self.lanes = dim // VEC
        self.groups = THREADS // self.lanes
        self.dim = dim
        self.vector = tidx % self.lanes
        self.group = tidx // self.lanes
        self.first = block * rows_per_cta


def _row(at: _Rows, step):
    """The row this thread takes at ``step``: the row groups interleave, so a warp reads neighbouring rows."""
    return at.first + step * at.groups + at.group


def _load_batch(at: _Rows, sources, step, last_row) -> None:
    """Rows step .. step + LOAD_BATCH − 1 of each (tensor, registers) pair, every load issued before any value
    is used (rows past the end clamped to the last: loaded, never stored)."""
    for i in range(LOAD_BATCH):
        row = cutlass.min(_row(at, step + i), last_row)
        for tensor, registers in sources:
            registers[i, None].store(tensor[row, at.vector, None].load())


def _rstd(at: _Rows, values, eps):
    """rsqrt(mean(x²) + eps) of the row whose 8 values ``values`` this thread holds."""
    squares = Float32(0.0)
    for e in range(VEC):
        squares = squares + values[e] * values[e]
    return cute.math.rsqrt(_row_sum(squares, at.lanes) / Float32(at.dim) + eps)


class _GatedRMSNormBase:
    def __init__(self, config: GatedRMSNormConfig):
        config.validate()
        self.dim = config.dim
        self.dtype = cutlass_dtype(config.dtype)


class GatedRMSNormKernel(_GatedRMSNormBase):
    @cute.jit
    def __call__(self,
                 x: cute.Tensor,  # [R, D/8, 8] input dtype
                 gate: cute.Tensor,  # [R, D/8, 8] input dtype
                 weight: cute.Tensor,  # [D/8, 8] float32
                 out: cute.Tensor,  # [R, D/8, 8] input dtype
                 eps: Float32,
                 stream):
        blocks = (x.shape[0] + GATED_NORM_FORWARD_ROWS - 1) // GATED_NORM_FORWARD_ROWS
        self.kernel(x, gate, weight, out, eps).launch(grid=(blocks, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, gate: cute.Tensor, weight: cute.Tensor, out: cute.Tensor, eps: Float32):
        at = _Rows(self.dim, GATED_NORM_FORWARD_ROWS)
        w_regs = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
        w_regs.store(weight[at.vector, None].load())
        x_batch = cute.make_rmem_tensor(cute.make_layout((LOAD_BATCH, VEC), stride=(VEC, 1)), self.dtype)
        g_batch = cute.make_rmem_tensor(cute.make_layout((LOAD_BATCH, VEC), stride=(VEC, 1)), self.dtype)
        result = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
        last_row = x.shape[0] - 1
        for step in cutlass.range(0, GATED_NORM_FORWARD_ROWS // at.groups, LOAD_BATCH):
            _load_batch(at, ((x, x_batch), (gate, g_batch)), step, last_row)
            for i in cutlass.range_constexpr(LOAD_BATCH):
                row = _row(at, step + i)
                values = x_batch[i, None].load().to(Float32)
                gates = g_batch[i, None].load().to(Float32)
                rstd = _rstd(at, values, eps)
                for e in cutlass.range_constexpr(VEC):
                    silu, _ = _silu_parts(gates[e])
                    result[e] = values[e] * rstd * w_regs[e] * silu
                if row <= last_row:
                    out[row, at.vector, None].store(result.load().to(self.dtype))


class GatedRMSNormBackwardKernel(_GatedRMSNormBase):  # config: GatedRMSNormBackwardConfig
    @cute.jit
    def __call__(self,
                 x: cute.Tensor,  # [R, D/8, 8] input dtype
                 gate: cute.Tensor,  # [R, D/8, 8] input dtype
                 weight: cute.Tensor,  # [D/8, 8] float32
                 dout: cute.Tensor,  # [R, D/8, 8] input dtype
                 dx: cute.Tensor,  # [R, D/8, 8] input dtype
                 dgate: cute.Tensor,  # [R, D/8, 8] input dtype
                 partials: cute.Tensor,  # [blocks, D/8, 8] float32
                 eps: Float32,
                 stream):
        blocks = (x.shape[0] + GATED_NORM_ROWS - 1) // GATED_NORM_ROWS
        self.kernel(x, gate, weight, dout, dx, dgate, partials, eps).launch(
            grid=(blocks, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, gate: cute.Tensor, weight: cute.Tensor, dout: cute.Tensor, dx: cute.Tensor,
               dgate: cute.Tensor, partials: cute.Tensor, eps: Float32):
        at = _Rows(self.dim, GATED_NORM_ROWS)
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        allocator = cutlass.utils.SmemAllocator()
        s_grads = allocator.allocate_tensor(Float32, cute.make_layout((THREADS, VEC), stride=(VEC, 1)), 16)
        w_regs = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
        w_regs.store(weight[at.vector, None].load())
        x_batch = cute.make_rmem_tensor(cute.make_layout((LOAD_BATCH, VEC), stride=(VEC, 1)), self.dtype)
        g_batch = cute.make_rmem_tensor(cute.make_layout((LOAD_BATCH, VEC), stride=(VEC, 1)), self.dtype)
        d_batch = cute.make_rmem_tensor(cute.make_layout((LOAD_BATCH, VEC), stride=(VEC, 1)), self.dtype)
        dx_regs = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
        dgate_regs = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
        dweighted = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)  # da · weight
        grads = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)  # sum of da · n over this thread's rows
        grads.fill(0.0)
        last_row = x.shape[0] - 1
        for step in cutlass.range(0, GATED_NORM_ROWS // at.groups, LOAD_BATCH):
            _load_batch(at, ((x, x_batch), (gate, g_batch), (dout, d_batch)), step, last_row)
            for i in cutlass.range_constexpr(LOAD_BATCH):
                row = _row(at, step + i)
                values = x_batch[i, None].load().to(Float32)
                gates = g_batch[i, None].load().to(Float32)
                douts = d_batch[i, None].load().to(Float32)
                rstd = _rstd(at, values, eps)
                dot = Float32(0.0)
                for e in cutlass.range_constexpr(VEC):
                    normed = values[e] * rstd
                    silu, silu_grad = _silu_parts(gates[e])
                    dgate_regs[e] = douts[e] * normed * w_regs[e] * silu_grad
                    da = douts[e] * silu
                    dweighted[e] = da * w_regs[e]
                    dot = dot + dweighted[e] * normed
                    if row <= last_row:  # clamped duplicate rows add nothing to the weight gradient
                        grads[e] = grads[e] + da * normed
                mean_dot = _row_sum(dot, at.lanes) / Float32(self.dim)
                for e in cutlass.range_constexpr(VEC):
                    dx_regs[e] = rstd * (dweighted[e] - values[e] * rstd * mean_dot)
                if row <= last_row:
                    dx[row, at.vector, None].store(dx_regs.load().to(self.dtype))
                    dgate[row, at.vector, None].store(dgate_regs.load().to(self.dtype))
        # the CTA's weight gradient: row groups added in order, one float32 row of partials
        s_grads[tidx, None].store(grads.load())
        cute.arch.sync_threads()
        if tidx < at.lanes:
            total = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
            total.fill(0.0)
            for group in cutlass.range_constexpr(THREADS // (self.dim // VEC)):
                total.store(total.load() + s_grads[group * at.lanes + tidx, None].load())
            partials[block, tidx, None].store(total.load())
