"""Flax NNX building blocks with torch's parameter layout: Linear (weight [out, in]), Embedding,
RMSNorm, GatedRMSNorm, ShortConvolution (weight [C, 1, W]), GatedMLP, and RoPE helpers.

``GatedRMSNorm`` runs on the fused CuTeDSL kernels torch's does (``kernel_gated_rms_norm``: XLA custom
calls through ``jax_api.gdp.kernel_calls``) where ``gated_norm_kernel_reason`` allows, else on jnp ops.

Keeping torch's layout (not ``nnx.Linear``'s ``kernel [in, out]``) makes the parameter table of
``cp_linear.model_config`` hold for both frameworks, so weight conversion is a plain copy.
Matmuls use ``Precision.HIGHEST`` so float32 stays float32 on GPUs (no TF32), as in torch.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from cp_linear.kernels import configs as kcfg
from cp_linear.kernels import launch as kl
from jax_api.gdp import kernel_calls
from jax_api.gdp.cutedsl import KERNEL_DTYPE_NAMES
from jax_api.layers.conv import kernel_short_conv, masked_causal_conv

HIGHEST = jax.lax.Precision.HIGHEST


def _uniform(rngs: nnx.Rngs, shape, bound: float, dtype) -> jax.Array:
    return jax.random.uniform(rngs.params(), shape, dtype, -bound, bound)


class Linear(nnx.Module):
    """``y = x @ weight.T (+ bias)``; weight [out, in] initialised like ``torch.nn.Linear``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, rngs: nnx.Rngs,
                 dtype=jnp.float32):
        bound = 1.0 / math.sqrt(in_features)
        self.weight = nnx.Param(_uniform(rngs, (out_features, in_features), bound, dtype))
        self.bias = nnx.Param(_uniform(rngs, (out_features,), bound, dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...].astype(x.dtype)
        y = jnp.einsum("...i,oi->...o", x, w, precision=HIGHEST)
        return y if self.bias is None else y + self.bias[...].astype(x.dtype)


class Embedding(nnx.Module):
    """weight [V, D]; ``__call__(ids [...]) -> [..., D]``."""

    def __init__(self, num_embeddings: int, features: int, *, rngs: nnx.Rngs, std: float = 1.0,
                 dtype=jnp.float32):
        self.weight = nnx.Param(std * jax.random.normal(rngs.params(), (num_embeddings, features), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


def _rms(x32: jax.Array, eps: float) -> jax.Array:
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` in float32, returned in x's dtype. x [..., D]."""

    def __init__(self, features: int, eps: float = 1e-5):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((features,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return (_rms(x.astype(jnp.float32), self.eps) * self.weight[...].astype(jnp.float32)).astype(x.dtype)


# --------------------------------------------------------------------------- the gated norm's kernel path

# Tests: take the gated norm's kernel path wherever its inputs fit, on any platform (on the CPU the custom
# calls run the emulations the tests register); only the platform check is skipped. As torch's flag of this name.
FORCE_GATED_NORM_KERNEL = False


def gated_norm_kernel_reason(x: jax.Array, gate: jax.Array) -> str | None:
    """Why ``kernel_gated_rms_norm`` cannot take x and gate [..., D] here (None when it can): the GDP
    kernels' platform (a Hopper GPU with the DSL and jax-tvm-ffi, ``jax_api.gdp.cutedsl.kernel_platform_reason``;
    ``FORCE_GATED_NORM_KERNEL`` skips this check), x and gate of one shape and dtype, bfloat16 or float16,
    with rows of D in ``GATED_NORM_DIMS``. Same rule as torch's ``gated_norm_kernel_reason``."""
    if not FORCE_GATED_NORM_KERNEL:
        from jax_api.gdp.cutedsl import kernel_platform_reason

        platform = kernel_platform_reason()
        if platform is not None:
            return platform
    if jnp.dtype(x.dtype) not in KERNEL_DTYPE_NAMES or gate.dtype != x.dtype or gate.shape != x.shape:
        return (f"the gated-norm kernels take x and gate of one shape in bf16 / fp16; received "
                f"{jnp.dtype(x.dtype).name} {list(x.shape)}, {jnp.dtype(gate.dtype).name} {list(gate.shape)}")
    if x.shape[-1] not in kcfg.GATED_NORM_DIMS:
        return f"the gated-norm kernels take rows of {kcfg.GATED_NORM_DIMS}; received {x.shape[-1]}"
    return None


def kernel_gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``x · rsqrt(mean(x²) + eps) · weight · silu(gate)`` per row on the fused kernels -> [..., D] in x's dtype.

    x, gate [..., D] of one dtype (bfloat16 / float16), D in ``GATED_NORM_DIMS``; weight [D] in any float
    dtype (the kernels take it as float32); eps a host number (static). Float32 arithmetic, one rounding.
    Differentiable in x, gate and weight: the backward kernel writes dx, dgate and one row of weight-gradient
    sums per CTA, which a second kernel adds in a fixed order, so dweight (weight's dtype) is deterministic.
    Works under jit, grad and inside ``shard_map`` (a replicated weight's gradient is summed over the axis).
    """
    if jnp.dtype(x.dtype) not in KERNEL_DTYPE_NAMES or gate.dtype != x.dtype or gate.shape != x.shape:
        raise ValueError(f"x and gate must be bfloat16 or float16 [..., D] of one shape and dtype; received "
                         f"{jnp.dtype(x.dtype).name} {list(x.shape)}, {jnp.dtype(gate.dtype).name} {list(gate.shape)}")
    if x.shape[-1] not in kcfg.GATED_NORM_DIMS or tuple(weight.shape) != x.shape[-1:]:
        raise ValueError(f"D must be one of {kcfg.GATED_NORM_DIMS} and weight [D]; received x [..., {x.shape[-1]}], "
                         f"weight {list(weight.shape)}")
    # one type for every operand inside shard_map: the custom_vjp's cotangents must match its primals
    return _kernel_gated_rms_norm(*kernel_calls.match_varying(x, gate, weight), float(eps))


def _vectors(t: jax.Array) -> jax.Array:
    """t [..., D] -> [..., D / 8, 8]: D as the kernels' 16-byte vectors (a free reshape)."""
    return t.reshape(*t.shape[:-1], t.shape[-1] // kcfg.SHORT_CONV_VECTOR, kcfg.SHORT_CONV_VECTOR)


def _norm_rows(t: jax.Array) -> jax.Array:
    """t [..., D] -> [R, D / 8, 8]: every leading index one row of the kernels."""
    return t.reshape(-1, t.shape[-1] // kcfg.SHORT_CONV_VECTOR, kcfg.SHORT_CONV_VECTOR)


def _gated_rms_norm_forward(x, gate, weight, eps) -> jax.Array:
    config = kcfg.GatedRMSNormConfig(KERNEL_DTYPE_NAMES[jnp.dtype(x.dtype)], x.shape[-1])
    x_rows = _norm_rows(x)
    inputs = dict(x=x_rows, gate=_norm_rows(gate), weight=_vectors(weight.astype(jnp.float32)))
    out = kernel_calls.launch(kl.GatedRMSNormLaunch, config, inputs=inputs, results=dict(out=x_rows.shape),
                              scalars=dict(eps=eps))
    return out["out"].reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel_gated_rms_norm(x, gate, weight, eps):
    return _gated_rms_norm_forward(x, gate, weight, eps)


def _kernel_gated_rms_norm_fwd(x, gate, weight, eps):
    # the backward kernel recomputes rsqrt(mean(x²) + eps) from x: only the inputs are kept
    return _gated_rms_norm_forward(x, gate, weight, eps), (x, gate, weight)


def _kernel_gated_rms_norm_bwd(eps, residuals, dout):
    x, gate, weight = residuals
    dim = x.shape[-1]
    config = kcfg.GatedRMSNormBackwardConfig(KERNEL_DTYPE_NAMES[jnp.dtype(x.dtype)], dim)
    x_rows = _norm_rows(x)
    # one row of weight-gradient sums per CTA, added in a fixed order by the column-sum kernel: deterministic
    partial_rows = kl.gated_rms_norm_partial_rows(x_rows.shape[0])
    grads = kernel_calls.launch(
        kl.GatedRMSNormBackwardLaunch, config,
        inputs=dict(x=x_rows, gate=_norm_rows(gate), weight=_vectors(weight.astype(jnp.float32)),
                    dout=_norm_rows(dout.astype(x.dtype))),
        results=dict(dx=x_rows.shape, dgate=x_rows.shape, partials=(partial_rows, *x_rows.shape[1:])),
        scalars=dict(eps=eps))
    rows = grads["partials"].reshape(partial_rows, -1, kcfg.COLUMN_SUM_VECTOR)
    sums = kernel_calls.launch(kl.ColumnSumLaunch, kcfg.ColumnSumConfig(), inputs=dict(rows=rows),
                               results=dict(sums=rows.shape[1:]), scalars={})["sums"]
    return grads["dx"].reshape(x.shape), grads["dgate"].reshape(gate.shape), sums.reshape(dim).astype(weight.dtype)


_kernel_gated_rms_norm.defvjp(_kernel_gated_rms_norm_fwd, _kernel_gated_rms_norm_bwd)


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) * silu(gate)`` (norm before gate). x, gate [..., D].

    Where ``gated_norm_kernel_reason`` allows (a Hopper GPU, x and gate in bf16 / fp16, D in
    ``GATED_NORM_DIMS``) one fused kernel each way (``kernel_gated_rms_norm``, torch's kernels); elsewhere
    jnp ops. Both compute in float32 and round once."""

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        if gated_norm_kernel_reason(x, gate) is None:
            return kernel_gated_rms_norm(x, gate, self.weight[...], self.eps)
        normed = _rms(x.astype(jnp.float32), self.eps) * self.weight[...].astype(jnp.float32)
        return (normed * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class ShortConvolution(nnx.Module):
    """Depthwise causal conv + SiLU; weight [C, 1, W] (and bias [C]) as ``torch.nn.Conv1d``."""

    def __init__(self, channels: int, kernel_size: int, *, bias: bool = False, rngs: nnx.Rngs, dtype=jnp.float32):
        bound = 1.0 / math.sqrt(kernel_size)
        self.weight = nnx.Param(_uniform(rngs, (channels, 1, kernel_size), bound, dtype))
        self.bias = nnx.Param(_uniform(rngs, (channels,), bound, dtype)) if bias else None

    def __call__(self, window: jax.Array, positions: jax.Array) -> jax.Array:
        bias = None if self.bias is None else self.bias[...].astype(window.dtype)
        return jax.nn.silu(masked_causal_conv(window, self.weight[...].astype(window.dtype), bias, positions))

    def fused(self, x: jax.Array, halo: jax.Array, positions: jax.Array) -> jax.Array:
        """The same conv + SiLU on the fused kernels (``conv.kernel_short_conv``): x [B, L, C] and halo
        [B, P, W - 1, C], the tokens before each of the P pieces of L (``conv.conv_halos``). The
        weight and bias enter as float32, unrounded."""
        bias = None if self.bias is None else self.bias[...]
        return kernel_short_conv(x, halo, self.weight[...], bias, positions)


class GatedMLP(nnx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden_size, intermediate_size, rngs=rngs)
        self.up_proj = Linear(hidden_size, intermediate_size, rngs=rngs)
        self.down_proj = Linear(intermediate_size, hidden_size, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin float32 [L, head_dim / 2] for integer positions [L] (rotate-half convention)."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate halves of x [B, L, H, D] by the angles of its token, in float32."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    first, second = x32[..., :half], x32[..., half:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


__all__ = ["FORCE_GATED_NORM_KERNEL", "Embedding", "GatedMLP", "GatedRMSNorm", "Linear", "RMSNorm", "ShortConvolution",
           "apply_rope", "gated_norm_kernel_reason", "kernel_gated_rms_norm", "rope_angles"]
