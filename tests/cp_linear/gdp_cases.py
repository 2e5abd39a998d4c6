"""Random GDP inputs shared by tests (numpy float64; frameworks convert)."""

import numpy as np


def random_gdp_inputs(rng, *, batch=1, tokens=24, heads=2, key_dim=8, value_dim=6, num_householder=1):
    n = num_householder
    q = rng.normal(size=(batch, tokens, heads, key_dim))
    k = rng.normal(size=(batch, tokens * n, heads, key_dim))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # keeps the recurrence contractive, as in real models
    v = rng.normal(size=(batch, tokens * n, heads, value_dim))
    g = -np.log1p(np.exp(-rng.normal(size=(batch, tokens, heads)) - 1.0))  # logsigmoid: log decay < 0
    beta = 1.0 / (1.0 + np.exp(-rng.normal(size=(batch, tokens * n, heads))))
    return q, k, v, g, beta


def seq_idx_from_lengths(lengths):
    return np.repeat(np.arange(len(lengths)), lengths).reshape(1, -1)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
