"""Inputs of the CuTeDSL-backend tests on the kernels' emulation (shared by the torch and JAX tests)."""

import torch


def emulation_inputs(lengths, heads, key_dim, value_dim, n_h, seed, rows=1):
    """bf16 q, k, v and float32 g (log-sigmoid, mostly near 0) and beta for ``rows`` rows of ``sum(lengths)``
    tokens (n_h steps per token for k, v, beta)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = r(rows, tokens, heads, key_dim).bfloat16()
    k = r(rows, tokens * n_h, heads, key_dim).bfloat16()
    v = r(rows, tokens * n_h, heads, value_dim).bfloat16()
    g = torch.nn.functional.logsigmoid(r(rows, tokens, heads) + 3.0)
    beta = torch.sigmoid(r(rows, tokens * n_h, heads))
    return q, k, v, g, beta
