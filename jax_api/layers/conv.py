"""Short causal depthwise convolution over packed documents with a CP halo, inside ``jax.shard_map``.

Same rule as ``torch_api.layers.conv``: token t reads t - W + 1 .. t, and tap s (token t - s)
is kept only when ``s <= position[t]`` (token t - s is in the same sequence). Under CP the
W - 1 tokens before the shard come from the left neighbour through one ``lax.ppermute`` (its
transpose sends the halo's gradient back); rank 0 receives zeros::

    rank r-1  ... a5 a6 a7 | rank r  a8 a9 b0 b1      window (W = 4): a5 a6 a7 a8 a9 b0 b1

Zig-zag (``cp_linear.zigzag``): each of the rank's two chunks gets its own window
(``zigzag_conv_windows``); chunk c reads the tail of chunk c − 1, wherever that lives.
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


def zigzag_conv_windows(x: jax.Array, halo_len: int, axis_name: str) -> tuple[jax.Array, jax.Array]:
    """x [B, L, C] holding chunks r and 2·cp−1−r (zig-zag) -> one window [B, halo_len + L / 2, C] per chunk.

    Chunk r's left context, chunk r − 1, is the first chunk of rank r − 1 (zeros for chunk 0); chunk
    2·cp−1−r's, chunk 2·cp−2−r, is the second chunk of rank r + 1, or this rank's first chunk on the
    last rank. Two ppermutes of ``halo_len`` tokens (torch gathers every rank's tails instead: the same
    windows); their transposes send the halos' gradients back. Needs ``halo_len <= L / 2``.
    """
    chunk = x.shape[1] // 2
    first, second = x[:, :chunk], x[:, chunk:]
    if halo_len == 0:
        return first, second
    cp_size = jax.lax.axis_size(axis_name)
    first_tail, second_tail = first[:, chunk - halo_len:], second[:, chunk - halo_len:]
    first_halo = jax.lax.ppermute(first_tail, axis_name, [(r, r + 1) for r in range(cp_size - 1)])
    second_halo = jax.lax.ppermute(second_tail, axis_name, [(r + 1, r) for r in range(cp_size - 1)])
    last_rank = jax.lax.axis_index(axis_name) == cp_size - 1
    second_halo = jnp.where(last_rank, first_tail, second_halo)
    return jnp.concatenate([first_halo, first], axis=1), jnp.concatenate([second_halo, second], axis=1)


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


__all__ = ["conv_window", "masked_causal_conv", "zigzag_conv_windows"]
