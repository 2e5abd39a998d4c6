"""Short causal depthwise convolution over packed documents, with a context-parallel halo.

Token t of a shard reads tokens t - W + 1 .. t (W = conv_size). Tap s (reading token t - s) is
kept only when ``s <= position[t]``, i.e. when token t - s belongs to the same sequence; so a
sequence never sees its predecessor, whether the boundary lies inside a shard or exactly on a
rank boundary. Under CP the W - 1 tokens before the shard come from the previous rank through one
differentiable neighbour exchange (the ``cp_linear::left_halo`` custom op over ``torch_api.attention.exchange.left_halo_forward``; its backward
returns the halo's gradient to the sender); rank 0 gets zeros::

    rank r-1  ... a5 a6 a7 | rank r  a8 a9 b0 b1      (document a continues, b starts at r*L + 2)
    window (W = 4):          a5 a6 a7 a8 a9 b0 b1
    a8 reads a5..a8 (positions >= 3); b0 reads only b0; b1 reads b0, b1

Two implementations of the conv + SiLU: ``masked_causal_conv`` (torch ops, one tap at a time, any dtype
and width) over the window of ``conv_window``, and ``kernel_short_conv``, the fused CuTeDSL
kernels (``cp_linear::short_conv``, ``torch_api.layers.library``) that read the shard in place and take
the W - 1 tokens before each piece as a separate halo. ``short_conv_kernel_reason`` chooses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

import torch_api.layers.library  # noqa: F401  (registers cp_linear::short_conv before any trace)

# Tests: take the kernel path wherever its inputs fit, skipping the platform check (on the CPU the ops
# run the kernels' emulation). Set it as ``torch_api.layers.conv.FORCE_SHORT_CONV_KERNEL = True``.
FORCE_SHORT_CONV_KERNEL = False


def conv_window(x: torch.Tensor, halo_len: int, group=None, *, gathered: bool = False) -> torch.Tensor:
    """x [B, L, C] -> [B, halo_len + L, C]: the ``halo_len`` tokens before the shard, then x.

    Without ``group`` (one device) the halo is zeros. Under CP it is the previous rank's last
    ``halo_len`` tokens (zeros on rank 0); needs ``halo_len <= L``, equal on every rank.
    ``gathered``: move it with an all-gather instead of a neighbour exchange (graph-ready layouts:
    collectives only; the same values).
    """
    if halo_len == 0:
        return x
    if group is None:
        return F.pad(x, (0, 0, halo_len, 0))
    if not 0 <= halo_len <= x.shape[1]:
        raise ValueError(f"halo_len must be in [0, L = {x.shape[1]}]; received {halo_len}")
    from torch_api.attention.library import left_halo_gathered_op, left_halo_op

    group_name = group if isinstance(group, str) else group.group_name
    token_major = x.transpose(0, 1)  # [L, B, C]: the exchange moves whole tokens along dim 0
    exchange = left_halo_gathered_op if gathered else left_halo_op
    return exchange(token_major, int(halo_len), group_name).transpose(0, 1)


def zigzag_conv_windows(x: torch.Tensor, halo_len: int, group, cp_rank: int, cp_size: int) -> list[torch.Tensor]:
    """x [B, L, C] in the zig-zag layout (chunks r and 2·cp−1−r, ``cp_linear.zigzag``) -> one window
    [B, halo_len + L / 2, C] per local chunk: the ``halo_len`` tokens before the chunk, then the chunk.

    Chunk c's left context is the tail of chunk c − 1, which lives on rank c − 1 (first chunk), on
    rank r + 1 (second chunk, r < cp − 1) or on this rank (the second chunk of rank cp − 1); chunk 0
    gets zeros. Every rank's two tails travel in one differentiable all-gather (backward:
    reduce-scatter), put in sequence order by ``gathered_chunk_order``. Needs ``halo_len <= L / 2``.
    """
    from cp_linear.zigzag import gathered_chunk_order, rank_chunks
    from torch_api.attention.exchange import all_gather_kv

    chunk = x.shape[1] // 2
    pieces = (x[:, :chunk], x[:, chunk:])
    if halo_len == 0:
        return list(pieces)
    if not 0 <= halo_len <= chunk:
        raise ValueError(f"halo_len must be in [0, L / 2 = {chunk}] (zig-zag chunk); received {halo_len}")
    tails = torch.cat([piece[:, chunk - halo_len:] for piece in pieces], dim=1).transpose(0, 1)  # [2h, B, C]
    gathered = all_gather_kv(tails.contiguous(), group).view(2 * cp_size, halo_len, *tails.shape[1:])
    in_order = gathered.index_select(0, torch.from_numpy(gathered_chunk_order(cp_size, "zigzag")).to(x.device))
    windows = []
    for piece, c in zip(pieces, rank_chunks(cp_rank, cp_size, "zigzag")):
        halo = in_order[c - 1].transpose(0, 1) if c > 0 else piece.new_zeros((piece.shape[0], halo_len, piece.shape[2]))
        windows.append(torch.cat((halo, piece), dim=1))
    return windows


def masked_causal_conv(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       positions: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of the last L tokens of ``window`` that never crosses a sequence start.

    window [B, W - 1 + L, C] (``conv_window``); weight [C, 1, W] (``torch.nn.Conv1d`` layout: tap
    ``W - 1`` multiplies the current token); bias [C] or None; positions int [L], each token's index
    within its sequence. Returns [B, L, C] before the activation.
    """
    width = weight.shape[-1]
    length = window.shape[1] - (width - 1)
    taps = weight[:, 0, :]  # [C, W]
    out = window[:, width - 1:] * taps[:, width - 1]
    for s in range(1, width):
        shifted = window[:, width - 1 - s:width - 1 - s + length]  # token t - s
        reach = (positions >= s).view(1, length, 1)
        out = out + torch.where(reach, shifted, 0.0) * taps[:, width - 1 - s]
    return out if bias is None else out + bias


def short_conv_kernel_reason(x: torch.Tensor, width: int, channels: Sequence[int]) -> str | None:
    """Why ``kernel_short_conv`` cannot run a conv of ``width`` taps over x [B, L, C] and its siblings of
    ``channels`` (None when it can): a Hopper GPU with the DSL installed (``FORCE_SHORT_CONV_KERNEL``
    skips this check), x in bfloat16 or float16, width in ``SHORT_CONV_WIDTHS`` and every count in
    ``channels`` a multiple of 8 (whole 16-byte vectors)."""
    if not FORCE_SHORT_CONV_KERNEL:
        from torch_api.gdp.cutedsl import kernel_platform_reason

        platform = kernel_platform_reason(x.device)
        if platform is not None:
            return platform
    return _short_conv_config_reason(x.dtype, width, channels)


def _short_conv_config_reason(dtype: torch.dtype, width: int, channels: Sequence[int]) -> str | None:
    from cp_linear.kernels.configs import SHORT_CONV_VECTOR, SHORT_CONV_WIDTHS

    if dtype not in (torch.bfloat16, torch.float16):
        return f"the short-conv kernels take bfloat16 or float16; received {dtype}"
    if width not in SHORT_CONV_WIDTHS:
        return f"the short-conv kernels take widths {SHORT_CONV_WIDTHS}; received {width}"
    if any(count % SHORT_CONV_VECTOR for count in channels):
        return f"the short-conv kernels need channels divisible by {SHORT_CONV_VECTOR}; received {tuple(channels)}"
    return None


def kernel_short_conv(x: torch.Tensor, halo: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      positions: torch.Tensor) -> torch.Tensor:
    """silu(masked causal conv) on the fused kernels (``cp_linear::short_conv``), differentiable in x,
    halo, weight and bias. x [B, L, C] bf16 / fp16, cut into P = halo.shape[1] equal pieces (one device:
    P = 1; zig-zag CP: P = 2, one per chunk); halo [B, P, W - 1, C] in x's dtype: the W - 1 tokens before
    each piece (zeros where nothing precedes it); weight [C, 1, W]; bias [C] or None; positions int [L] as
    in ``masked_causal_conv``. Returns [B, L, C] in x's dtype. Checks shapes only (no host read)."""
    error = _kernel_short_conv_error(x, halo, weight, bias, positions)
    if error is not None:
        raise ValueError(f"kernel_short_conv: {error}")
    return torch.ops.cp_linear.short_conv(x, halo, weight, bias, positions)


def _kernel_short_conv_error(x, halo, weight, bias, positions) -> str | None:
    if x.dim() != 3 or weight.dim() != 3 or weight.shape[1] != 1 or weight.shape[0] != x.shape[2]:
        return f"expected x [B, L, C] and weight [C, 1, W]; received {tuple(x.shape)} and {tuple(weight.shape)}"
    batch, length, channels = x.shape
    width = weight.shape[2]
    reason = _short_conv_config_reason(x.dtype, width, [channels])
    if reason is not None:
        return reason
    if halo.dim() != 4 or halo.shape[0] != batch or halo.shape[2:] != (width - 1, channels) or halo.shape[1] < 1:
        return f"expected halo [B, P, W - 1, C] = [{batch}, P, {width - 1}, {channels}]; received {tuple(halo.shape)}"
    if length % halo.shape[1]:
        return f"L = {length} must divide into P = {halo.shape[1]} equal pieces"
    if halo.dtype != x.dtype:
        return f"halo must have x's dtype {x.dtype}; received {halo.dtype}"
    if bias is not None and tuple(bias.shape) != (channels,):
        return f"expected bias [C] = [{channels}]; received {tuple(bias.shape)}"
    if tuple(positions.shape) != (length,):
        return f"expected positions [L] = [{length}]; received {tuple(positions.shape)}"
    return None


def naive_document_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        cu_seqlens) -> torch.Tensor:
    """Reference: ``F.conv1d`` with causal zero padding, run on each sequence separately.

    x [1, T, C] (the whole packed sequence), cu_seqlens ints [N + 1]. Returns [1, T, C].
    """
    width = weight.shape[-1]
    bounds = [int(b) for b in cu_seqlens]
    pieces = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        seq = x[:, start:stop].transpose(1, 2)  # [1, C, n]
        out = F.conv1d(F.pad(seq, (width - 1, 0)), weight, bias, groups=weight.shape[0])
        pieces.append(out.transpose(1, 2))
    return torch.cat(pieces, dim=1)


__all__ = ["conv_window", "kernel_short_conv", "masked_causal_conv", "naive_document_conv", "short_conv_kernel_reason",
           "zigzag_conv_windows"]
