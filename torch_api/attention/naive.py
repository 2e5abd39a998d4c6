"""Plain-torch block-diagonal causal attention over a whole sequence: the reference for tests.

Differentiable and float64-capable; materialises the full [T, T] mask, so only for small T.
"""

from __future__ import annotations

import torch


def naive_blockdiag_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor,
                              *, scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention within each document; padding rows (doc id 0) are exactly 0.

    q [B, T, Hq, D], k/v [B, T, Hkv, D] (Hq a multiple of Hkv), doc_ids int [T]. Returns [B, T, Hq, D].
    """
    tokens, q_heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    group = q_heads // k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    ids = doc_ids.to(device=q.device).reshape(tokens)
    position = torch.arange(tokens, device=q.device)
    allowed = (ids[:, None] == ids[None, :]) & (position[None, :] <= position[:, None]) & (ids[:, None] > 0)
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    logits = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    logits = logits.masked_fill(~allowed, float("-inf"))
    # a padding row has no allowed key; give it a finite row so softmax (and its gradient) stays finite
    logits = logits.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    weights = torch.softmax(logits, dim=-1) * allowed
    return torch.einsum("bhij,bjhd->bihd", weights, v)
