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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F



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


__all__ = ["conv_window", "zigzag_conv_windows", "masked_causal_conv", "naive_document_conv"]
