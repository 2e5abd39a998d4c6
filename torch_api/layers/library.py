"""``torch.library`` custom ops of the layers: the fused short conv (``cp_linear.kernels.short_conv``) and
the gated output norm (``cp_linear.kernels.gated_rms_norm``), with fake (meta) kernels and registered
autograd, so that ``torch.compile(fullgraph=True)`` traces a layer through them without graph breaks.

Ops (namespace ``cp_linear``; every output a fresh contiguous tensor):

  short_conv           (x [B, L, C], halo [B, P, W - 1, C], weight [C, 1, W], bias [C]?, positions int [L])
                       -> y [B, L, C] = silu(masked causal conv), in x's dtype (bf16 / fp16)
  short_conv_backward  (dy, x, halo, weight, bias?, positions)
                       -> (dx [B, L, C], dhalo [B, P, W - 1, C], weight_and_bias_grads f32 [W + 1, C])

  gated_rms_norm           (x [..., D], gate [..., D], weight [D], eps) -> x · rsqrt(mean(x²) + eps) · weight
                           · silu(gate) in x's dtype (bf16 / fp16; D in ``GATED_NORM_DIMS``)
  gated_rms_norm_backward  (dout, x, gate, weight, eps) -> (dx, dgate, dweight float32 [D])

x is cut into P equal pieces of L / P tokens (one device: P = 1; zig-zag CP: P = 2, one per chunk);
piece p reads the W - 1 tokens before it from ``halo[:, p]``. Rows 0 .. W - 1 of
``weight_and_bias_grads`` are the weight gradient tap by tap (``weight[:, 0, tap]``), row W the
bias gradient; the autograd formula reshapes them to the parameters' layouts. On a CUDA device the
ops run the CuTeDSL kernels on the current stream (no host synchronisation); on the CPU they run the
kernels' emulation (``cp_linear.kernels.emulation``: the same launches, in torch), so tests and
``torch.library.opcheck`` exercise the launch path without a GPU.
"""

from __future__ import annotations

import torch

from torch_api.gdp.cutedsl import KERNEL_DTYPE_NAMES  # the kernels' dtype names, as the GDP backend's


def _vectors(t: torch.Tensor) -> torch.Tensor:
    """``t`` [..., C] with its channels as the kernels' 16-byte vectors [..., C / 8, 8]: contiguous, at a
    16-byte aligned address (a view into a larger tensor may not be), detached (DLPack exports no tensor
    that requires grad)."""
    from cp_linear.kernels.configs import SHORT_CONV_VECTOR

    t = t.detach().contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t.view(*t.shape[:-1], t.shape[-1] // SHORT_CONV_VECTOR, SHORT_CONV_VECTOR)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Token-major ``t`` [B, ..., C] as [rows, C / 8, 8] (``_vectors``)."""
    vectors = _vectors(t)
    return vectors.view(-1, *vectors.shape[-2:])


def _run(launch, device: torch.device) -> None:
    """The compiled kernel on a CUDA device, its torch emulation elsewhere."""
    if device.type == "cuda":
        launch.run()
    else:
        from cp_linear.kernels.emulation import run_emulated

        run_emulated(launch)


def _parameters(weight: torch.Tensor, bias: torch.Tensor | None, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [C, 1, W] -> float32 [W, C] (tap W - 1 multiplies the current token), bias [C] or None ->
    float32 [C] (zeros for a conv without one), both as 16-byte vector rows."""
    taps = _vectors(weight.detach()[:, 0].t().float())
    bias = weight.new_zeros(channels, dtype=torch.float32) if bias is None else bias.float()
    return taps, _vectors(bias)


def _launch_inputs(x, halo, weight, bias, positions):
    """The arguments both kernels read: (x rows, halo rows, weight [W, C/8, 8], bias [C/8, 8],
    positions int32 [L], pieces P)."""
    taps, bias_vector = _parameters(weight, bias, x.shape[-1])
    return _rows(x), _rows(halo), taps, bias_vector, positions.to(torch.int32).contiguous(), halo.shape[1]


@torch.library.custom_op("cp_linear::short_conv", mutates_args=())
def short_conv(x: torch.Tensor, halo: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               positions: torch.Tensor) -> torch.Tensor:
    from cp_linear.kernels import configs as kcfg
    from cp_linear.kernels import launch as kl

    batch, length, channels = x.shape
    x_rows, halo_rows, taps, bias_vector, positions32, pieces = _launch_inputs(x, halo, weight, bias, positions)
    y = torch.empty_like(x_rows)
    config = kcfg.ShortConvConfig(KERNEL_DTYPE_NAMES[x.dtype], weight.shape[-1])
    _run(kl.ShortConvLaunch(config, x_rows, halo_rows, taps, bias_vector, positions32, y, pieces), x.device)
    return y.view(batch, length, channels)


@short_conv.register_fake
def _(x, halo, weight, bias, positions):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("cp_linear::short_conv_backward", mutates_args=())
def short_conv_backward(dy: torch.Tensor, x: torch.Tensor, halo: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None, positions: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from cp_linear.kernels import configs as kcfg
    from cp_linear.kernels import launch as kl

    batch, length, channels = x.shape
    width = weight.shape[-1]
    x_rows, halo_rows, taps, bias_vector, positions32, pieces = _launch_inputs(x, halo, weight, bias, positions)
    dx, dhalo = torch.empty_like(x_rows), torch.empty_like(halo_rows)
    # one row of partial sums per run of tokens, summed in a fixed order by the column-sum kernel: the
    # weight gradient is deterministic (no atomics)
    partial_rows = kl.short_conv_partial_rows(batch, length, pieces)
    partials = x.new_empty((partial_rows, width + 1, *taps.shape[1:]), dtype=torch.float32)
    backward = kcfg.ShortConvBackwardConfig(KERNEL_DTYPE_NAMES[x.dtype], width)
    _run(kl.ShortConvBackwardLaunch(backward, x_rows, halo_rows, taps, bias_vector, positions32, _rows(dy.to(x.dtype)),
                                    dx, dhalo, partials, pieces), x.device)
    column = kcfg.COLUMN_SUM_VECTOR
    sums = x.new_empty(((width + 1) * channels // column, column), dtype=torch.float32)
    _run(kl.ColumnSumLaunch(kcfg.ColumnSumConfig(), partials.view(partial_rows, -1, column), sums), x.device)
    return dx.view(x.shape), dhalo.view(halo.shape), sums.view(width + 1, channels)


@short_conv_backward.register_fake
def _(dy, x, halo, weight, bias, positions):
    width, channels = weight.shape[-1], x.shape[-1]
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(halo, memory_format=torch.contiguous_format),
            x.new_empty((width + 1, channels), dtype=torch.float32))


def _setup_short_conv(ctx, inputs, output):
    x, halo, weight, bias, positions = inputs
    ctx.save_for_backward(x, halo, weight, bias, positions)


def _short_conv_autograd(ctx, dy):
    x, halo, weight, bias, positions = ctx.saved_tensors
    dx, dhalo, weight_and_bias_grads = short_conv_backward(dy, x, halo, weight, bias, positions)
    width = weight.shape[-1]
    dweight = weight_and_bias_grads[:width].t().reshape(weight.shape).to(weight.dtype)  # [W, C] -> [C, 1, W]
    dbias = None if bias is None else weight_and_bias_grads[width].to(bias.dtype)
    return dx, dhalo, dweight, dbias, None


short_conv.register_autograd(_short_conv_autograd, setup_context=_setup_short_conv)


@torch.library.custom_op("cp_linear::gated_rms_norm", mutates_args=())
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from cp_linear.kernels import configs as kcfg
    from cp_linear.kernels import launch as kl

    x_rows = _rows(x)
    out = torch.empty_like(x_rows)
    config = kcfg.GatedRMSNormConfig(KERNEL_DTYPE_NAMES[x.dtype], x.shape[-1])
    _run(kl.GatedRMSNormLaunch(config, x_rows, _rows(gate), _vectors(weight.float()), out, eps), x.device)
    return out.view(x.shape)


@gated_rms_norm.register_fake
def _(x, gate, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("cp_linear::gated_rms_norm_backward", mutates_args=())
def gated_rms_norm_backward(dout: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from cp_linear.kernels import configs as kcfg
    from cp_linear.kernels import launch as kl

    dim = x.shape[-1]
    x_rows = _rows(x)
    dx, dgate = torch.empty_like(x_rows), torch.empty_like(x_rows)
    # one row of weight-gradient sums per CTA, added in a fixed order by the column-sum kernel: deterministic
    blocks = kl.gated_rms_norm_partial_rows(x_rows.shape[0])
    partials = x.new_empty((blocks, *x_rows.shape[1:]), dtype=torch.float32)
    config = kcfg.GatedRMSNormBackwardConfig(KERNEL_DTYPE_NAMES[x.dtype], dim)
    _run(kl.GatedRMSNormBackwardLaunch(config, x_rows, _rows(gate), _vectors(weight.float()), _rows(dout.to(x.dtype)),
                                       dx, dgate, partials, eps), x.device)
    column = kcfg.COLUMN_SUM_VECTOR
    sums = x.new_empty((dim // column, column), dtype=torch.float32)
    _run(kl.ColumnSumLaunch(kcfg.ColumnSumConfig(), partials.view(blocks, -1, column), sums), x.device)
    return dx.view(x.shape), dgate.view(x.shape), sums.view(dim)


@gated_rms_norm_backward.register_fake
def _(dout, x, gate, weight, eps):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[-1:], dtype=torch.float32))


def _setup_gated_rms_norm(ctx, inputs, output):
    x, gate, weight, eps = inputs
    ctx.save_for_backward(x, gate, weight)
    ctx.eps = eps


def _gated_rms_norm_autograd(ctx, dout):
    x, gate, weight = ctx.saved_tensors
    dx, dgate, dweight = gated_rms_norm_backward(dout, x, gate, weight, ctx.eps)
    return dx, dgate, dweight.to(weight.dtype), None


gated_rms_norm.register_autograd(_gated_rms_norm_autograd, setup_context=_setup_gated_rms_norm)


__all__ = ["gated_rms_norm", "gated_rms_norm_backward", "short_conv", "short_conv_backward"]
