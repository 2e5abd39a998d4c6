"""The Gated DeltaProduct recurrence token by token in jnp: obvious, slow, differentiable.

The test oracle for the chunked backend (``jax.grad`` of it gives reference gradients; run it
under ``jax.enable_x64(True)`` with float64 inputs for float64 references). docs/design.md §2::

    for t in tokens of the sequence:
        S = exp(g[t]) * S
        for j in 0..n_h-1:            i = t*n_h + j
            S = S + beta[i] * outer(k[i], v[i] - S^T k[i])
        o[t] = scale * S^T q[t]

Shapes: q [B, T, H, K], k [B, T*n_h, H, K], v [B, T*n_h, H, V], g [B, T, H], beta [B, T*n_h, H].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cp_linear.gdp import check_gdp_shapes, cu_seqlens_error
from jax_api.gdp.chunk import l2norm


def naive_gated_delta_product(q, k, v, g, beta, *, scale=None, num_householder=1, cu_seqlens=None,
                              initial_state=None, use_qk_l2norm_in_kernel=False):
    """The recurrence with host ``cu_seqlens`` (int [N + 1], B = 1) or None (each row a sequence).

    initial_state [N, H, K, V] (N = B without cu_seqlens), zeros when None.
    Returns (o [B, T, H, V], final_state [N, H, K, V]) in the inputs' dtype.
    """
    batch, tokens = q.shape[:2]
    sequence_index = None
    if cu_seqlens is not None:
        cu = np.asarray(cu_seqlens, np.int64)
        error = cu_seqlens_error(cu.reshape(-1).tolist(), tokens) if batch == 1 and cu.ndim == 1 else \
            f"cu_seqlens [N + 1] needs B = 1; received shape {cu.shape} with B = {batch}"
        if error:
            raise ValueError(error)
        sequence_index = jnp.asarray(np.repeat(np.arange(cu.shape[0] - 1), np.diff(cu)), jnp.int32)
    if initial_state is None:
        count = batch if cu_seqlens is None else len(cu_seqlens) - 1
        initial_state = jnp.zeros((count, q.shape[2], q.shape[3], v.shape[3]), q.dtype)
    return naive_recurrence(q, k, v, g, beta, sequence_index, initial_state, scale=scale,
                            num_householder=num_householder, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def naive_recurrence(q, k, v, g, beta, sequence_index, initial_state, *, scale=None, num_householder=1,
                     use_qk_l2norm_in_kernel=False):
    """One ``lax.scan`` over tokens; the packing is data, so jit it once for many packings.

    sequence_index: int [T], the 0-based sequence number of each token (B = 1, nondecreasing,
    may be traced), or None for B independent rows. initial_state: [N, H, K, V] (N = B when
    sequence_index is None). Returns (o [B, T, H, V], final_state [N, H, K, V]).
    """
    check_gdp_shapes(q.shape, k.shape, v.shape, g.shape, beta.shape, num_householder)
    batch, tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    n = num_householder
    scale = key_dim**-0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    packed = sequence_index is not None
    if packed and batch != 1:
        raise ValueError(f"sequence_index describes one packed row: B must be 1; received B = {batch}")
    expected_states = (initial_state.shape[0] if packed else batch, heads, key_dim, value_dim)
    if tuple(initial_state.shape) != expected_states:
        raise ValueError(f"initial_state must be [N, H, K, V] = {expected_states}; received "
                         f"{tuple(initial_state.shape)}")
    initial_state = initial_state.astype(q.dtype)
    if packed:
        starts = jnp.concatenate([jnp.ones((1,), bool), sequence_index[1:] != sequence_index[:-1]])
        per_token = (sequence_index, starts)
    else:
        per_token = (jnp.zeros((tokens,), jnp.int32), jnp.zeros((tokens,), bool))

    def step(carry, token):
        state, final = carry  # [B, H, K, V], [N, H, K, V]
        q_t, k_t, v_t, g_t, b_t, seq, start = token
        if packed:  # a new sequence starts from its own initial state
            state = jnp.where(start, initial_state[seq][None], state)
        state = jnp.exp(g_t)[:, :, None, None] * state
        for j in range(n):
            predicted = jnp.einsum("bhkv,bhk->bhv", state, k_t[:, j])
            state = state + b_t[:, j, :, None, None] * k_t[:, j, :, :, None] * (v_t[:, j] - predicted)[:, :, None, :]
        out = scale * jnp.einsum("bhkv,bhk->bhv", state, q_t)
        final = final.at[seq].set(state[0]) if packed else state  # a sequence's last token writes last
        return (state, final), out

    k = k.reshape(batch, tokens, n, heads, key_dim)
    v = v.reshape(batch, tokens, n, heads, value_dim)
    beta = beta.reshape(batch, tokens, n, heads)
    tokens_major = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g.astype(q.dtype), beta.astype(q.dtype)))
    first = jnp.zeros((batch, heads, key_dim, value_dim), q.dtype) if packed else initial_state
    # an empty sequence (no token) keeps its initial state as its final state
    (_, final), out = jax.lax.scan(step, (first, initial_state), (*tokens_major, *per_token))
    return jnp.moveaxis(out, 0, 1), final
