"""Short causal depthwise convolution over packed documents with a CP halo, inside ``jax.shard_map``.

Same rule as ``torch_api.layers.conv``: token t reads t - W + 1 .. t, and tap s (token t - s)
is kept only when ``s <= position[t]`` (token t - s is in the same sequence). Under CP the
W - 1 tokens before the shard come from the left neighbour through one ``lax.ppermute`` (its
transpose sends the halo's gradient back); rank 0 receives zeros::

    rank r-1  ... a5 a6 a7 | rank r  a8 a9 b0 b1      window (W = 4): a5 a6 a7 a8 a9 b0 b1

Zig-zag (``cp_linear.zigzag``): each of the rank's two chunks gets its own window
(``zigzag_conv_windows``); chunk c reads the tail of chunk c − 1, wherever that lives.

The kernel path (``kernel_short_conv``) runs the fused CuTeDSL kernels, the ones torch calls, as XLA
custom calls. It takes no window: x itself plus a halo [B, P, W − 1, C] holding the W − 1 tokens before
each of the P pieces of the shard (``conv_halos``: zeros on one device; under CP one exchange of the
projections' last W − 1 tokens; P = 2 for the zig-zag chunks, else 1)::

    rank r-1  ... a5 a6 a7 | rank r  x = a8 a9 b0 b1      halo [B, 1, 3, C] = a5 a6 a7   (W = 4)
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cp_linear.kernels import configs as kcfg
from cp_linear.kernels import launch as kl
from jax_api.gdp import kernel_calls
from jax_api.gdp.cutedsl import KERNEL_DTYPE_NAMES


# Tests: take the kernel path wherever its inputs fit, on any platform (on the CPU the custom calls run
# the emulations the tests register); only the platform check is skipped. As torch's flag of this name.
FORCE_SHORT_CONV_KERNEL = False


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


def conv_halos(parts: Sequence[jax.Array], halo_len: int, axis_name: str | None = None, *,
               zigzag: bool = False) -> list[jax.Array]:
    """The kernel path's halo of each x_i [B, L, C_i] in ``parts`` -> [B, P, halo_len, C_i] each.

    One device (``axis_name`` None): zeros, P = 1. Contiguous CP: the left rank's last ``halo_len``
    tokens (zeros on rank 0), P = 1. Zig-zag CP: each local chunk's left context, P = 2. Under CP only
    the parts' last ``halo_len`` tokens (of each chunk) travel, concatenated over the parts so that one
    exchange serves them all (``conv_window`` / ``zigzag_conv_windows`` on that small tensor; the first
    ``halo_len`` tokens of each window are the halo). Needs ``1 <= halo_len`` and ``halo_len`` <= the
    piece length.
    """
    batch, length = parts[0].shape[:2]
    if axis_name is None:
        return [jnp.zeros((batch, 1, halo_len, part.shape[-1]), part.dtype) for part in parts]
    ends = (length // 2, length) if zigzag else (length,)  # where each piece ends
    tails = jnp.concatenate([jnp.concatenate([part[:, end - halo_len:end] for part in parts], axis=-1)
                             for end in ends], axis=1)  # [B, P · halo_len, C_total]
    if zigzag:
        windows = zigzag_conv_windows(tails, halo_len, axis_name)
    else:
        windows = [conv_window(tails, halo_len, axis_name)]
    halo = jnp.stack([window[:, :halo_len] for window in windows], axis=1)  # [B, P, halo_len, C_total]
    return jnp.split(halo, np.cumsum([part.shape[-1] for part in parts])[:-1].tolist(), axis=-1)


# --------------------------------------------------------------------------- the kernel path


def short_conv_kernel_reason(x: jax.Array, width: int, channels: Sequence[int]) -> str | None:
    """Why ``kernel_short_conv`` cannot run a conv of ``width`` taps over x [B, L, C] and its siblings of
    ``channels`` here (None when it can): the GDP kernels' platform (a Hopper GPU with the DSL and
    jax-tvm-ffi, ``jax_api.gdp.cutedsl.kernel_platform_reason``; ``FORCE_SHORT_CONV_KERNEL`` skips this
    check), x in bfloat16 or float16, width in ``SHORT_CONV_WIDTHS`` and every count in ``channels`` a
    multiple of 8 (whole 16-byte vectors). Same rule as torch's ``short_conv_kernel_reason``."""
    if not FORCE_SHORT_CONV_KERNEL:
        from jax_api.gdp.cutedsl import kernel_platform_reason

        platform = kernel_platform_reason()
        if platform is not None:
            return platform
    if jnp.dtype(x.dtype) not in KERNEL_DTYPE_NAMES:
        return f"the short-conv kernels take bfloat16 or float16; received {jnp.dtype(x.dtype).name}"
    if width not in kcfg.SHORT_CONV_WIDTHS:
        return f"the short-conv kernels take widths {kcfg.SHORT_CONV_WIDTHS}; received {width}"
    if any(count % kcfg.SHORT_CONV_VECTOR for count in channels):
        return (f"the short-conv kernels need channels divisible by {kcfg.SHORT_CONV_VECTOR}; received "
                f"{tuple(channels)}")
    return None


def kernel_short_conv(x: jax.Array, halo: jax.Array, weight: jax.Array, bias: jax.Array | None,
                      positions: jax.Array) -> jax.Array:
    """silu(masked causal conv) of x [B, L, C] on the fused kernels -> y [B, L, C] in x's dtype.

    L is P = ``halo.shape[1]`` equal pieces; halo [B, P, W − 1, C] (x's dtype) holds the W − 1 tokens
    before each piece (``conv_halos``). weight [C, 1, W] (tap W − 1 multiplies the current token) and
    bias [C] or None in any float dtype (the kernels take them as float32); positions int [L], each
    token's index in its sequence: tap s reads token t − s only when s <= positions[t]. The value of
    ``silu(masked_causal_conv([halo_p; piece_p], ...))`` per piece, summed in float32.

    Differentiable in x, halo, weight and bias (positions get none): the backward kernel writes dx,
    dhalo and per-run partial sums of the weight and bias gradients, which a second kernel sums in a
    fixed order, so gradients are deterministic. Works under jit, grad and inside ``shard_map`` (a
    replicated weight's gradient is summed over the axis, as for any replicated input).
    """
    _check_kernel_arguments(x, halo, weight, bias, positions)
    # one type for every operand inside shard_map: the custom_vjp's cotangents must match its primals
    return _kernel_short_conv(*kernel_calls.match_varying(x, halo, weight, bias, jnp.asarray(positions, jnp.int32)))


def _check_kernel_arguments(x, halo, weight, bias, positions) -> None:
    if x.ndim != 3 or jnp.dtype(x.dtype) not in KERNEL_DTYPE_NAMES:
        raise ValueError(f"x must be bfloat16 or float16 [B, L, C]; received {jnp.dtype(x.dtype).name} "
                         f"{list(x.shape)}")
    batch, length, channels = x.shape
    width = weight.shape[-1]
    if tuple(weight.shape) != (channels, 1, width) or width not in kcfg.SHORT_CONV_WIDTHS:
        raise ValueError(f"weight must be [C, 1, W] with C = {channels} and W in {kcfg.SHORT_CONV_WIDTHS}; "
                         f"received {list(weight.shape)}")
    if channels % kcfg.SHORT_CONV_VECTOR:
        raise ValueError(f"C must be divisible by {kcfg.SHORT_CONV_VECTOR}; received {channels}")
    pieces = halo.shape[1] if halo.ndim == 4 else 0
    if (halo.dtype != x.dtype or tuple(halo.shape) != (batch, pieces, width - 1, channels) or pieces == 0
            or length % pieces):
        raise ValueError(f"halo must be {jnp.dtype(x.dtype).name} [B, P, W - 1, C] = [{batch}, P, {width - 1}, "
                         f"{channels}] with P dividing L = {length}; received {jnp.dtype(halo.dtype).name} "
                         f"{list(halo.shape)}")
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"bias must be [C] = [{channels}] or None; received {list(bias.shape)}")
    if tuple(positions.shape) != (length,) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be integer [L] = [{length}]; received {jnp.dtype(positions.dtype).name} "
                         f"{list(positions.shape)}")


def _kernel_inputs(x, halo, weight, bias, positions) -> dict:
    """The short-conv launches' inputs: channels as [C / 8, 8] vectors, one row per token of x and
    halo; weight tap-major float32 [W, C / 8, 8]; bias float32 [C / 8, 8] (zeros when None)."""
    channels = x.shape[-1]
    vectors = (channels // kcfg.SHORT_CONV_VECTOR, kcfg.SHORT_CONV_VECTOR)
    taps = jnp.transpose(weight[:, 0, :]).astype(jnp.float32)  # [W, C]
    bias = jnp.zeros((channels,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    return dict(x=x.reshape(-1, *vectors), halo=halo.reshape(-1, *vectors), weight=taps.reshape(-1, *vectors),
                bias=bias.reshape(vectors), positions=positions)


def _short_conv_forward(x, halo, weight, bias, positions) -> jax.Array:
    config = kcfg.ShortConvConfig(KERNEL_DTYPE_NAMES[jnp.dtype(x.dtype)], weight.shape[-1])
    inputs = _kernel_inputs(x, halo, weight, bias, positions)
    out = kernel_calls.launch(kl.ShortConvLaunch, config, inputs=inputs, results=dict(y=inputs["x"].shape),
                              scalars=dict(pieces=halo.shape[1]))
    return out["y"].reshape(x.shape)


@jax.custom_vjp
def _kernel_short_conv(x, halo, weight, bias, positions):
    return _short_conv_forward(x, halo, weight, bias, positions)


def _kernel_short_conv_fwd(x, halo, weight, bias, positions):
    # the backward kernel recomputes the pre-activation from the inputs: nothing else is kept
    return _short_conv_forward(x, halo, weight, bias, positions), (x, halo, weight, bias, positions)


def _kernel_short_conv_bwd(residuals, dy):
    x, halo, weight, bias, positions = residuals
    batch, length, channels = x.shape
    width, pieces = weight.shape[-1], halo.shape[1]
    config = kcfg.ShortConvBackwardConfig(KERNEL_DTYPE_NAMES[jnp.dtype(x.dtype)], width)
    inputs = _kernel_inputs(x, halo, weight, bias, positions)
    partial_rows = kl.short_conv_partial_rows(batch, length, pieces)
    grads = kernel_calls.launch(
        kl.ShortConvBackwardLaunch, config,
        inputs=dict(inputs, dy=dy.astype(x.dtype).reshape(inputs["x"].shape)),
        results=dict(dx=inputs["x"].shape, dhalo=inputs["halo"].shape,
                     partials=(partial_rows, width + 1, *inputs["bias"].shape)),
        scalars=dict(pieces=pieces))
    rows = grads["partials"].reshape(partial_rows, -1, kcfg.COLUMN_SUM_VECTOR)
    sums = kernel_calls.launch(kl.ColumnSumLaunch, kcfg.ColumnSumConfig(), inputs=dict(rows=rows),
                               results=dict(sums=rows.shape[1:]), scalars={})["sums"]
    weight_and_bias = sums.reshape(width + 1, channels)  # rows 0 .. W - 1: the taps; row W: the bias
    dweight = jnp.transpose(weight_and_bias[:width])[:, None, :].astype(weight.dtype)
    dbias = None if bias is None else weight_and_bias[width].astype(bias.dtype)
    return grads["dx"].reshape(x.shape), grads["dhalo"].reshape(halo.shape), dweight, dbias, None


_kernel_short_conv.defvjp(_kernel_short_conv_fwd, _kernel_short_conv_bwd)


__all__ = ["FORCE_SHORT_CONV_KERNEL", "conv_halos", "conv_window", "kernel_short_conv", "masked_causal_conv",
           "short_conv_kernel_reason", "zigzag_conv_windows"]
