"""Plain jnp doc-masked causal attention over the full sequence: the reference for the CP version."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def naive_blockdiag_attention(q, k, v, doc_ids, *, scale=None):
    """Causal softmax within each document; padding rows (doc id 0) output zeros. Differentiable.

    q [B, T, Hq, D], k/v [B, T, Hkv, D] (Hq a multiple of Hkv), doc_ids int [T] (may be traced).
    Computes in float32 (highest matmul precision) and returns [B, T, Hq, D] in q's dtype.
    """
    tokens, head_dim = q.shape[1], q.shape[3]
    group = q.shape[2] // k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    q32 = q.astype(jnp.float32)
    k32 = jnp.repeat(k.astype(jnp.float32), group, axis=2)
    v32 = jnp.repeat(v.astype(jnp.float32), group, axis=2)
    ids = jnp.asarray(doc_ids).reshape(tokens)
    position = jnp.arange(tokens)
    same_doc_causal = (ids[:, None] == ids[None, :]) & (position[None, :] <= position[:, None])
    logits = jnp.einsum("bihd,bjhd->bhij", q32, k32, precision=jax.lax.Precision.HIGHEST) * scale
    # Padding rows see only themselves (doc 0 == doc 0), so the softmax is finite; zero them after.
    weights = jax.nn.softmax(jnp.where(same_doc_causal, logits, -jnp.inf), axis=-1)
    out = jnp.einsum("bhij,bjhd->bihd", weights, v32, precision=jax.lax.Precision.HIGHEST)
    return jnp.where((ids > 0)[None, :, None, None], out, 0.0).astype(q.dtype)
