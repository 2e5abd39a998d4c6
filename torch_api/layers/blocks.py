"""Small building blocks of the layers: norms, the short conv's parameters, SwiGLU MLP, RoPE.

Parameter names and shapes follow flash-linear-attention (``weight`` everywhere, conv weights
``[C, 1, W]``); norms compute in float32 and return the input dtype; ``Linear`` casts float32 weights to
lower-precision activations (a bf16 residual stream without autocast).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_api.layers.library  # noqa: F401  (registers the layers' custom ops before any trace)
from torch_api.layers.conv import masked_causal_conv


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis. x [..., D]."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's rms_norm: one fused kernel each way on a GPU, the same float32 math (autocast keeps it
            # float32); on the H200 3.7x faster than the ops below at 32k x 2048 (bench_layer_kernels.py)
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        if x.dtype in (torch.bfloat16, torch.float16) and self.weight.dtype == torch.float32:
            # a half-precision row (a bf16 residual stream): the same fused float32 kernel on the widened row,
            # one rounding at the end, as JAX's RMSNorm (torch's own rms_norm of a bf16 row would round before
            # the float32 weight multiplies, and return float32)
            return F.rms_norm(x.float(), x.shape[-1:], self.weight, self.eps).to(x.dtype)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


# Tests: take the gated norm's kernel path wherever its inputs fit, skipping the platform check (on the CPU
# the ops run the kernels' emulation). Set it as ``torch_api.layers.blocks.FORCE_GATED_NORM_KERNEL = True``.
FORCE_GATED_NORM_KERNEL = False


def gated_norm_kernel_reason(x: torch.Tensor, gate: torch.Tensor) -> str | None:
    """Why the fused gated-norm kernels (``cp_linear::gated_rms_norm``) cannot take x and gate (None when
    they can): a Hopper GPU with the DSL (unless ``FORCE_GATED_NORM_KERNEL``), x and gate of one shape and
    dtype, bfloat16 or float16, with rows of D in ``GATED_NORM_DIMS``."""
    from cp_linear.kernels.configs import GATED_NORM_DIMS

    if not FORCE_GATED_NORM_KERNEL:
        from torch_api.gdp.cutedsl import kernel_platform_reason

        platform = kernel_platform_reason(x.device)
        if platform is not None:
            return platform
    if x.dtype not in (torch.bfloat16, torch.float16) or gate.dtype != x.dtype or gate.shape != x.shape:
        return f"the gated-norm kernels take x and gate of one shape in bf16 / fp16; received {x.dtype}, {gate.dtype}"
    if x.shape[-1] not in GATED_NORM_DIMS:
        return f"the gated-norm kernels take rows of {GATED_NORM_DIMS}; received {x.shape[-1]}"
    return None


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) * silu(gate)`` (FLA's ``FusedRMSNormGated``, norm before gate). x, gate [..., D].

    On a Hopper GPU with x and gate in bf16 / fp16 (``gated_norm_kernel_reason``) one fused kernel each way
    (``cp_linear::gated_rms_norm``); elsewhere torch ops. Both compute in float32 and round once."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if gated_norm_kernel_reason(x, gate) is None:
            return torch.ops.cp_linear.gated_rms_norm(x, gate, self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (normed * F.silu(gate.float())).to(x.dtype)


class ShortConvolution(nn.Module):
    """Depthwise causal conv + SiLU with FLA's ``ShortConvolution`` parameters (weight [C, 1, W], bias [C]).

    ``forward(window, positions)`` takes the halo-extended input of ``conv.conv_window``; the conv
    itself is ``conv.masked_causal_conv`` (never crosses a sequence start).
    """

    def __init__(self, channels: int, kernel_size: int, bias: bool = False):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None
        bound = 1.0 / math.sqrt(kernel_size)  # torch.nn.Conv1d's default for a depthwise conv
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, window: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # a bf16 window meets the float32 taps in float32 (type promotion); one rounding back to the window's
        # dtype after the SiLU, as the fused kernels (``kernel_short_conv``) round
        return F.silu(masked_causal_conv(window, self.weight, self.bias, positions)).to(window.dtype)


class Linear(nn.Linear):
    """``torch.nn.Linear`` (same parameters) that also takes activations of a lower-precision float dtype than
    its weights without autocast: the weight (and bias) are cast to the activations' dtype at the matmul, as
    JAX's ``Linear`` does (``w.astype(x.dtype)``), so a bf16 residual stream (``HybridDecoder(compute_dtype=)``)
    runs with float32 weights. Activations as wide as the weights take ``nn.Linear``'s own call, bitwise;
    under autocast a bf16 x gives what autocast's own cast gives."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.dtype.itemsize < self.weight.dtype.itemsize:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.weight.to(x.dtype), bias)
        return super().forward(x)


class GatedMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``. x [..., D]."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [L, head_dim / 2] for integer positions [L] (rotate-half convention)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of x [B, L, H, D] by the angles of its token; computed in float32."""
    half = x.shape[-1] // 2
    x32 = x.float()
    first, second = x32[..., :half], x32[..., half:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)


__all__ = ["GatedMLP", "GatedRMSNorm", "Linear", "RMSNorm", "ShortConvolution", "apply_rope", "rope_angles"]
