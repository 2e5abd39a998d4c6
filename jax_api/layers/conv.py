"""Short causal depthwise convolution over packed documents with a CP halo, inside ``jax.shard_map``.

Same rule as ``torch_api.layers.conv``: token t reads t - W + 1 .. t, and tap s (token t - s)
is kept only when ``s <= position[t]`` (token t - s is in the same sequence). Under CP the
W - 1 tokens before the shard come from the left neighbour through one ``lax.ppermute`` (its
transpose sends the halo's gradient back); rank 0 receives zeros::

    rank r-1  ... a5 a6 a7 | rank r  a8 a9 b0 b1      window (W = 4): a5 a6 a7 a8 a9 b0 b1
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def conv_window(x: jax.Array, halo_len: int, axis_name: str | None = None) -> jax.Array:
    """x [B, L, C] -> [B, halo_len + L, C]: zeros (one device, rank 0) or the left rank's last tokens."""
    if halo_len == 0:
        return x
    if axis_name is None:
        return jnp.pad(x, ((0, 0), (halo_len, 0), (0, 0)))
    cp_size = jax.lax.axis_size(axis_name)
    halo = jax.lax.ppermute(x[:, x.shape[1] - halo_len:], axis_name, [(r, r + 1) for r in range(cp_size - 1)])
    return jnp.concatenate([halo, x], axis=1)


def masked_causal_conv(window: jax.Array, weight: jax.Array, bias: jax.Array | None, positions: jax.Array) -> jax.Array:
    """Depthwise causal conv of the last L tokens of window [B, W - 1 + L, C] that never crosses a
    sequence start. weight [C, 1, W] (tap W - 1 multiplies the current token), bias [C] or None,
    positions int [L] (index of each token within its sequence). Returns [B, L, C] before activation."""
    width = weight.shape[-1]
    length = window.shape[1] - (width - 1)
    taps = weight[:, 0, :]
    out = window[:, width - 1:] * taps[:, width - 1]
    for s in range(1, width):
        shifted = window[:, width - 1 - s:width - 1 - s + length]
        reach = (positions >= s)[None, :, None]
        out = out + jnp.where(reach, shifted, 0) * taps[:, width - 1 - s]
    return out if bias is None else out + bias


__all__ = ["conv_window", "masked_causal_conv"]
