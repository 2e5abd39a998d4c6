"""Flax NNX building blocks with torch's parameter layout: Linear (weight [out, in]), Embedding,
RMSNorm, GatedRMSNorm, ShortConvolution (weight [C, 1, W]), GatedMLP, and RoPE helpers.

Keeping torch's layout (not ``nnx.Linear``'s ``kernel [in, out]``) makes the parameter table of
``cp_linear.model_config`` hold for both frameworks, so weight conversion is a plain copy.
Matmuls use ``Precision.HIGHEST`` so float32 stays float32 on GPUs (no TF32), as in torch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jax_api.layers.conv import masked_causal_conv

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


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) * silu(gate)`` (norm before gate). x, gate [..., D]."""

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
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


__all__ = ["Embedding", "GatedMLP", "GatedRMSNorm", "Linear", "RMSNorm", "ShortConvolution", "apply_rope",
           "rope_angles"]
