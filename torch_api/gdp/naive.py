"""The Gated DeltaProduct recurrence token by token, in torch (docs/design.md §2).

Slow and obvious on purpose (the test oracle with autograd; ``cp_linear.reference`` is the float64
numpy one): differentiable, runs in the input dtype (use float64 as the autograd
oracle in tests), one Python step per token and Householder step.
q [B, T, H, K], k [B, T*n_h, H, K], v [B, T*n_h, H, V], g [B, T, H], beta [B, T*n_h, H];
initial_state [N, H, K, V] (N sequences: B rows, or the entries of cu_seqlens when B = 1).
Returns (o [B, T, H, V], final_state [N, H, K, V]).
"""

from __future__ import annotations

import torch

from cp_linear.gdp import L2NORM_EPS


def naive_gated_delta_product(q, k, v, g, beta, *, scale=None, num_householder=1, initial_state=None,
                              cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    if g is None:  # no gate
        g = q.new_zeros(q.shape[:3])
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    batch, tokens, heads, key_dim = q.shape
    scale = key_dim**-0.5 if scale is None else scale
    n = num_householder
    bounds = [int(x) for x in cu_seqlens] if cu_seqlens is not None else None
    sequences = ([(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)] if bounds is not None
                 else [(row, 0, tokens) for row in range(batch)])
    outputs = {}
    finals = []
    for seq, (row, start, stop) in enumerate(sequences):
        state = (q.new_zeros(heads, key_dim, v.shape[-1]) if initial_state is None
                 else initial_state[seq].to(q.dtype))  # [H, K, V]
        for t in range(start, stop):
            state = state * torch.exp(g[row, t])[:, None, None]
            for j in range(n):
                key, value, b = k[row, t * n + j], v[row, t * n + j], beta[row, t * n + j]
                predicted = torch.einsum("hkv,hk->hv", state, key)
                state = state + b[:, None, None] * key[:, :, None] * (value - predicted)[:, None, :]
            outputs[row, t] = scale * torch.einsum("hkv,hk->hv", state, q[row, t])
        finals.append(state)
    o = torch.stack([torch.stack([outputs[row, t] for t in range(tokens)]) for row in range(batch)])
    return o, torch.stack(finals)
