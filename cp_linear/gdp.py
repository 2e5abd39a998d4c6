"""Gated DeltaProduct as every backend and frontend sees it (no torch or jax here).

The layouts and the recurrence are docs/design.md §2. ``GDPInputs`` is what the
four-function protocol (``cp_linear.protocol``) hands a backend, in torch and in JAX alike; JAX
registers it as a pytree (arrays are leaves, the rest static).

    q     [B, T, H, K]
    k     [B, T*n_h, H, K]      the j-th key of token t at index t*n_h + j
    v     [B, T*n_h, H, V]
    g     [B, T, H]             natural-log decay, applied once per token (zeros: no gate)
    beta  [B, T*n_h, H]
    cu_seqlens     int32 [N + 1] local sequence offsets of a packed row (B = 1), or None when each
                   batch row is one sequence (continuing across ranks under CP). Sequences may be
                   empty (equal offsets).
    initial_state  float32 [N, H, K, V] (None: zeros): the state each local sequence starts from;
                   under CP the first one is then advanced by the preceding ranks' summaries
    output_final_state  when True, ``cp_forward_apply`` returns ``(o, final_state [N, H, K, V])``
                   as its output, and ``cp_backward_prepare`` takes ``(do, d_final_state)``
    save_for_backward   False when no backward will run (inference, no_grad): a backend may then
                   skip what it keeps only for its backward (the kernel backend's saved buffer)
    token_flags    None, or (state_bad, read_bad) uint8 [B, T, H] (nonzero: flagged) when the inputs are
                   raw and may hold NaN / ±Inf (containment, ``cp_linear.validation``): the backend must
                   compute as if the k, v rows of every step of a state_bad token and the q row of a
                   read_bad token were zero, and every non-finite g and beta 0 (what it gives the finite
                   outputs equals the sanitised inputs'); it returns NaN as the output of a read_bad token
                   and takes that output's gradient as zero. read_bad holds at least the tokens whose q is
                   non-finite and at most the poisoned ones (``gdp_token_poison``): a caller that flags
                   every poisoned token needs no select over o and dO of its own. Only a backend with
                   ``zeroes_flagged_rows`` True receives them (the kernel backends: the chunk kernels zero
                   those rows as they load, the output scan stores the NaN)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

L2NORM_EPS = 1e-6  # q and k / sqrt(sum(x^2) + L2NORM_EPS) with use_qk_l2norm_in_kernel
MAX_KEY_DIM = 256  # bounds the [K, K] transition every summary carries
MAX_VALUE_DIM = 512  # covers flash-linear-attention's default layer (head_dim 256, expand_v 2)

Array = Any


@dataclass(frozen=True)
class GDPInputs:
    """One shard (or one device) of a Gated DeltaProduct layer; see the module docstring."""

    q: Array
    k: Array
    v: Array
    g: Array
    beta: Array
    scale: float
    num_householder: int = 1
    use_qk_l2norm_in_kernel: bool = False
    cu_seqlens: Array | None = None
    initial_state: Array | None = None
    output_final_state: bool = False
    save_for_backward: bool = True
    token_flags: tuple[Array, Array] | None = None

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def num_sequences(self) -> int:
        """N: entries of cu_seqlens minus one, or the batch rows."""
        return int(self.cu_seqlens.shape[0]) - 1 if self.is_packed else int(self.q.shape[0])

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """[N, H, K, V] of initial and final states."""
        return (self.num_sequences, int(self.q.shape[2]), int(self.q.shape[3]), int(self.v.shape[-1]))


class GDPInputGradients(NamedTuple):
    """Gradients with the shapes and dtypes of the matching ``GDPInputs`` fields
    (``dinitial_state`` float32 [N, H, K, V] when the inputs carried an initial state)."""

    dq: Array
    dk: Array
    dv: Array
    dg: Array
    dbeta: Array
    dinitial_state: Array | None = None


def check_gdp_shapes(q_shape, k_shape, v_shape, g_shape, beta_shape, num_householder: int) -> None:
    """Raise ValueError unless the five shapes agree with docs/design.md §2."""
    if not isinstance(num_householder, int) or isinstance(num_householder, bool) or num_householder < 1:
        raise ValueError(f"num_householder must be a positive int; received {num_householder!r}")
    if len(q_shape) != 4:
        raise ValueError(f"q must be [B, T, H, K]; received shape {tuple(q_shape)}")
    batch, tokens, heads, key_dim = q_shape
    steps = tokens * num_householder
    expected = {
        "k": (batch, steps, heads, key_dim),
        "g": (batch, tokens, heads),
        "beta": (batch, steps, heads),
    }
    for name, shape in (("k", k_shape), ("g", g_shape), ("beta", beta_shape)):
        if tuple(shape) != expected[name]:
            raise ValueError(
                f"{name} must have shape {expected[name]} for q {tuple(q_shape)} and num_householder "
                f"{num_householder}; received {tuple(shape)}"
            )
    if len(v_shape) != 4 or tuple(v_shape[:3]) != (batch, steps, heads):
        raise ValueError(f"v must have shape ({batch}, {steps}, {heads}, V); received {tuple(v_shape)}")


def cu_seqlens_error(values, tokens: int) -> str | None:
    """Host values of cu_seqlens: nondecreasing from 0 to T (empty sequences allowed), or a message."""
    values = [int(x) for x in values]
    if len(values) < 2 or values[0] != 0 or values[-1] != tokens or any(b < a for a, b in zip(values, values[1:])):
        return f"cu_seqlens must be nondecreasing from 0 to T = {tokens} with at least 2 entries; received {values}"
    return None


__all__ = ["GDPInputGradients", "GDPInputs", "L2NORM_EPS", "MAX_KEY_DIM", "MAX_VALUE_DIM", "check_gdp_shapes",
           "cu_seqlens_error"]
