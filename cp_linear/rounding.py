"""How far two computations of the same quantity may drift apart from rounding alone (no torch or jax).

A value computed with unit roundoff ``u`` (float32: 2^-24) through a chain of ``n`` rounded
accumulations carries a relative error of about ``u * sqrt(n)`` times the cancellation of the
computation, ``kappa = sum|terms| / |sum terms|`` (Higham, *Accuracy and Stability of Numerical
Algorithms*, ch. 3; the probabilistic bound of Higham & Mary, 2019). ``rounding_tolerance`` allows
``SAFETY`` times that, doubled when both sides carry the rounding (two float32 runs of a model,
e.g. with and without context parallelism). The test suite (tests/tolerance.py) and the examples'
step-0 parity check use it; it moves with the size of the computation, not with the machine.
"""

from __future__ import annotations

import math

SAFETY = 16.0

UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}


def unit_roundoff(dtype) -> float:
    """u of a dtype given as a name, a numpy / jax dtype or a torch dtype."""
    name = str(dtype).replace("torch.", "").replace("jnp.", "")
    if name not in UNIT_ROUNDOFF:
        import numpy as np

        name = np.dtype(dtype).name
    return UNIT_ROUNDOFF[name]


def rounding_tolerance(length: int, *, cancellation: float = 1.0, dtype="float32",
                       compared_with: str = "exact") -> float:
    """Relative (norm-wise) tolerance for a ``dtype`` result of ``length`` chained accumulations.

    ``compared_with="exact"``: against a reference whose own error is negligible (float64 for a
    float32 result); ``"rounded"``: against a result that carries ``dtype`` rounding too (doubled).
    """
    if length < 1 or cancellation < 1.0 - 1e-12:
        raise ValueError(f"length must be >= 1 and cancellation >= 1; received {length}, {cancellation}")
    factor = {"exact": 1.0, "rounded": 2.0}[compared_with]
    return factor * SAFETY * unit_roundoff(dtype) * math.sqrt(length) * cancellation


def gdp_length(tokens: int, num_householder: int, key_dim: int) -> int:
    """Gated DeltaProduct: every state entry accumulates S = T * n_h rank-one updates, each read
    through a K-term product (chunked or not: the chunk's UT transform chains the same steps)."""
    return tokens * num_householder * key_dim


def attention_length(tokens: int, head_dim: int) -> int:
    """Softmax attention: a D-term score, then a sum over up to T keys (forward and backward)."""
    return tokens * head_dim


def layer_length(config, tokens: int, batch: int = 1) -> int:
    """A layer (``cp_linear.model_config`` config) on sequences of ``tokens``: the projections, the
    mixer, the output projection and, for a gradient, the sum over all ``batch * tokens`` tokens."""
    if hasattr(config, "num_householder"):  # GDPConfig
        mixer = gdp_length(tokens, config.num_householder, config.head_dim) + config.conv_size
        return config.hidden_size + mixer + config.value_dim + batch * tokens
    mixer = attention_length(tokens, config.dim_per_head)
    return config.hidden_size + mixer + config.num_heads * config.dim_per_head + batch * tokens


def decoder_length(config, tokens: int) -> int:
    """A ``DecoderConfig`` model: every block's mixer chain and MLP, then the vocabulary projection."""
    blocks = sum(layer_length(config.gdp_config() if kind == "gdp" else config.attention_config(), tokens)
                 + 2 * config.mlp_width for kind in config.layer_types)
    return blocks + config.hidden_size + config.vocab_size


__all__ = ["SAFETY", "attention_length", "decoder_length", "gdp_length", "layer_length", "rounding_tolerance",
           "unit_roundoff"]
