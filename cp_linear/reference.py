"""Float64 numpy ground truth: the plain GDP recurrence, its chunked WY/UT form, and
document-masked softmax attention. Slow and obvious on purpose; every backend is tested
against these.

Shapes follow docs/design.md §2: q [B, T, H, K], k [B, T*n_h, H, K], v [B, T*n_h, H, V],
beta [B, T*n_h, H], g [B, T, H] (None: no gate); states [N, H, K, V]. ``cu_seqlens`` may hold empty
sequences, whose final state is their initial state.
"""

from __future__ import annotations

import numpy as np

from cp_linear._host import to_host_array, to_host_int_array
from cp_linear.chunking import CHUNK_SIZE
from cp_linear.gdp import L2NORM_EPS, check_gdp_shapes, cu_seqlens_error


def _f64(x, name: str) -> np.ndarray:
    return to_host_array(x, name).astype(np.float64)


def l2norm(x: np.ndarray) -> np.ndarray:
    """x / sqrt(sum(x^2) + L2NORM_EPS) over the last axis (``cp_linear.gdp``)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _sequences(batch: int, tokens: int, cu_seqlens) -> list[tuple[int, int, int]]:
    """(batch row, start, stop) of every sequence."""
    if cu_seqlens is None:
        return [(row, 0, tokens) for row in range(batch)]
    cu = to_host_int_array(cu_seqlens, "cu_seqlens")
    if batch != 1:
        raise ValueError(f"cu_seqlens needs B = 1 (a packed batch); received B = {batch}")
    error = cu_seqlens_error(cu.tolist(), tokens) if cu.ndim == 1 else f"cu_seqlens must be 1-D; received {cu.shape}"
    if error:
        raise ValueError(error)
    return [(0, int(cu[n]), int(cu[n + 1])) for n in range(cu.shape[0] - 1)]


def _gate(g, q) -> np.ndarray:
    """g as float64, or zeros [B, T, H] for no gate."""
    return np.zeros(np.shape(q)[:3]) if g is None else _f64(g, "g")


def _prepare(q, k, v, g, beta, scale, num_householder, initial_state, cu_seqlens, use_qk_l2norm_in_kernel):
    g = _gate(g, q)
    q, k, v, beta = (_f64(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v"), (beta, "beta")))
    check_gdp_shapes(q.shape, k.shape, v.shape, g.shape, beta.shape, num_householder)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    batch, tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    sequences = _sequences(batch, tokens, cu_seqlens)
    if initial_state is None:
        initial_state = np.zeros((len(sequences), heads, key_dim, value_dim))
    initial_state = _f64(initial_state, "initial_state")
    if initial_state.shape != (len(sequences), heads, key_dim, value_dim):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = {(len(sequences), heads, key_dim, value_dim)}; "
            f"received {initial_state.shape}"
        )
    scale = key_dim**-0.5 if scale is None else float(scale)
    return q, k, v, g, beta, scale, sequences, initial_state


def naive_gated_delta_product(q, k, v, g, beta, *, scale=None, num_householder=1, initial_state=None,
                              cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """The GDP recurrence token by token. Returns (o [B, T, H, V], final_state [N, H, K, V])."""
    q, k, v, g, beta, scale, sequences, initial_state = _prepare(
        q, k, v, g, beta, scale, num_householder, initial_state, cu_seqlens, use_qk_l2norm_in_kernel)
    output = np.zeros(q.shape[:3] + (v.shape[-1],))
    final_state = np.zeros_like(initial_state)
    for seq, (row, start, stop) in enumerate(sequences):
        state = initial_state[seq].copy()  # [H, K, V]
        for t in range(start, stop):
            state *= np.exp(g[row, t])[:, None, None]
            for j in range(num_householder):
                i = t * num_householder + j
                key, value, b = k[row, i], v[row, i], beta[row, i]
                predicted = np.einsum("hkv,hk->hv", state, key)
                state += b[:, None, None] * key[:, :, None] * (value - predicted)[:, None, :]
            output[row, t] = scale * np.einsum("hkv,hk->hv", state, q[row, t])
        final_state[seq] = state
    return output, final_state


# --------------------------------------------------------------------------- chunked WY / UT form


def expand_householder(q, g, num_householder: int):
    """Interleave per token into n_h steps: q sits on the last step, the gate on the first.

    q [B, T, H, K] -> [B, T*n_h, H, K]; g [B, T, H] -> [B, T*n_h, H]. GDP is then a gated delta
    rule over T*n_h steps that reads its output on every n_h-th step.
    """
    batch, tokens, heads, key_dim = q.shape
    q_steps = np.zeros((batch, tokens, num_householder, heads, key_dim))
    q_steps[:, :, -1] = q
    g_steps = np.zeros((batch, tokens, num_householder, heads))
    g_steps[:, :, 0] = g
    return q_steps.reshape(batch, -1, heads, key_dim), g_steps.reshape(batch, -1, heads)


def wy_chunk(k, v, beta, g):
    """WY/UT quantities of one chunk of C steps (all float64, heads batched).

    k [C, H, K], v [C, H, V], beta [C, H], g [C, H] (log decay per step). With G the cumulative
    gate and the UT transform ``T = (I + tril(beta_i k_i.k_j exp(G_i - G_j), -1))^-1``:
      w  = T diag(beta exp(G)) k      [H, C, K]   (how the incoming state enters the new values)
      u  = T diag(beta) v             [H, C, V]   (new values with zero incoming state)
      decay[i, j] = exp(G_i - G_j) for i >= j, else 0   [H, C, C]
      gate = exp(G)                   [H, C]
    so that new values are ``u - w S0`` and the chunk ends in
    ``S_end = M S0 + E`` with ``M = exp(G_C) I - k_end^T w`` and ``E = k_end^T u``,
    ``k_end[j] = exp(G_C - G_j) k_j``.
    """
    cum = np.cumsum(g, axis=0).T  # [H, C]
    chunk = cum.shape[1]
    causal = np.tril(np.ones((chunk, chunk), dtype=bool))
    decay = np.where(causal, np.exp(np.where(causal, cum[:, :, None] - cum[:, None, :], 0.0)), 0.0)
    kk = np.einsum("ihk,jhk->hij", k, k)
    strict = np.tril(np.ones((chunk, chunk)), -1)
    lower = beta.T[:, :, None] * kk * decay * strict
    ut = np.linalg.inv(np.eye(chunk) + lower)  # unit lower triangular, so always invertible
    gate = np.exp(cum)
    w = ut @ ((beta.T * gate)[:, :, None] * k.transpose(1, 0, 2))
    u = ut @ (beta.T[:, :, None] * v.transpose(1, 0, 2))
    k_end = np.exp(cum[:, -1:] - cum)[:, :, None] * k.transpose(1, 0, 2)  # [H, C, K]
    transition = gate[:, -1, None, None] * np.eye(k.shape[-1]) - np.einsum("hck,hcl->hkl", k_end, w)
    update = np.einsum("hck,hcv->hkv", k_end, u)
    return {"w": w, "u": u, "decay": decay, "gate": gate, "k_end": k_end,
            "transition": transition, "update": update}


def _chunked_sequence(q_steps, k, v, g_steps, beta, scale, state, chunk_size):
    """Run one sequence (steps [S, H, ...]) chunk by chunk from ``state``; return outputs per step."""
    steps = k.shape[0]
    out = np.zeros(q_steps.shape[:2] + (v.shape[-1],))
    for start in range(0, steps, chunk_size):
        sl = slice(start, min(start + chunk_size, steps))
        c = wy_chunk(k[sl], v[sl], beta[sl], g_steps[sl])
        new_values = c["u"] - c["w"] @ state  # [H, C, V]
        qc = q_steps[sl].transpose(1, 0, 2)  # [H, C, K]
        intra = (qc @ k[sl].transpose(1, 2, 0)) * c["decay"]  # [H, C, C]
        o = c["gate"][:, :, None] * (qc @ state) + intra @ new_values
        out[sl] = scale * o.transpose(1, 0, 2)
        state = c["transition"] @ state + c["update"]
    return out, state


def chunked_gated_delta_product(q, k, v, g, beta, *, scale=None, num_householder=1, initial_state=None,
                                cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size=CHUNK_SIZE):
    """The same function as ``naive_gated_delta_product``, computed by the chunked WY/UT algorithm.

    Chunks hold ``chunk_size`` interleaved steps and start at each sequence's start.
    """
    q, k, v, g, beta, scale, sequences, initial_state = _prepare(
        q, k, v, g, beta, scale, num_householder, initial_state, cu_seqlens, use_qk_l2norm_in_kernel)
    q_steps, g_steps = expand_householder(q, g, num_householder)
    n = num_householder
    output = np.zeros(q.shape[:3] + (v.shape[-1],))
    final_state = np.zeros_like(initial_state)
    for seq, (row, start, stop) in enumerate(sequences):
        sl = slice(start * n, stop * n)
        out_steps, final_state[seq] = _chunked_sequence(
            q_steps[row, sl], k[row, sl], v[row, sl], g_steps[row, sl], beta[row, sl], scale,
            initial_state[seq].copy(), chunk_size)
        output[row, start:stop] = out_steps[n - 1 :: n]
    return output, final_state


def shard_forward_summary(k, v, g, beta, *, num_householder=1, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                          chunk_size=CHUNK_SIZE):
    """Packed forward summary ``[E | M]`` of one shard's trailing fragment, float64.

    Inputs are one shard (B = 1 with local ``cu_seqlens``, or B rows that each continue a
    sequence): returns [H, K, V + K] for B = 1 with cu_seqlens, else [B, H, K, V + K].
    E is the trailing fragment's final state from zero; M multiplies the chunk transitions
    and is zero when the trailing fragment starts inside the shard.
    """
    k, v, g, beta = (_f64(x, name) for x, name in ((k, "k"), (v, "v"), (g, "g"), (beta, "beta")))
    if use_qk_l2norm_in_kernel:
        k = l2norm(k)
    batch, steps, heads, key_dim = k.shape
    tokens = g.shape[1]
    n = num_householder
    _, g_steps = expand_householder(np.zeros((batch, tokens, heads, 1)), g, n)
    sequences = _sequences(batch, tokens, cu_seqlens)
    summaries = []
    for row in range(batch):
        row_sequences = [s for s in sequences if s[0] == row]
        _, start, stop = row_sequences[-1]
        transition = np.broadcast_to(np.eye(key_dim), (heads, key_dim, key_dim)).copy()
        update = np.zeros((heads, key_dim, v.shape[-1]))
        for chunk_start in range(start * n, stop * n, chunk_size):
            sl = slice(chunk_start, min(chunk_start + chunk_size, stop * n))
            c = wy_chunk(k[row, sl], v[row, sl], beta[row, sl], g_steps[row, sl])
            transition = c["transition"] @ transition
            update = c["transition"] @ update + c["update"]
        if start != 0:
            transition = np.zeros_like(transition)
        summaries.append(np.concatenate([update, transition], axis=-1))
    packed = np.stack(summaries)
    return packed[0] if cu_seqlens is not None else packed


# --------------------------------------------------------------------------- attention


def blockdiag_attention(q, k, v, doc_ids, *, scale=None):
    """Causal softmax attention within each document; padding rows (doc id 0) output zeros.

    q [B, T, Hq, D], k/v [B, T, Hkv, D] (GQA: Hq a multiple of Hkv), doc_ids int [T].
    Returns float64 [B, T, Hq, D].
    """
    q, k, v = _f64(q, "q"), _f64(k, "k"), _f64(v, "v")
    ids = to_host_int_array(doc_ids, "doc_ids").reshape(-1)
    batch, tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"q heads ({q_heads}) must be a multiple of k/v heads ({kv_heads})")
    if ids.shape[0] != tokens:
        raise ValueError(f"doc_ids has {ids.shape[0]} entries for T = {tokens}")
    scale = head_dim**-0.5 if scale is None else float(scale)
    group = q_heads // kv_heads
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    position = np.arange(tokens)
    allowed = (ids[:, None] == ids[None, :]) & (position[None, :] <= position[:, None]) & (ids[:, None] > 0)
    logits = np.einsum("bihd,bjhd->bhij", q, k) * scale
    logits = np.where(allowed[None, None], logits, -np.inf)
    row_max = np.max(logits, axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.where(allowed[None, None], np.exp(logits - row_max), 0.0)
    denom = np.sum(weights, axis=-1, keepdims=True)
    weights = weights / np.where(denom > 0, denom, 1.0)
    return np.einsum("bhij,bjhd->bihd", weights, v)
