"""One-device Gated DeltaProduct in JAX: ``gated_delta_product`` -> (o, final_state), differentiable.

Mirrors ``cp_linear.reference.naive_gated_delta_product`` (naive form: ``jax_api.gdp.naive``) and
the torch op ``torch_api.gated_delta_product``. It runs through the backend's four functions
(``cp_linear.protocol``) with empty neighbour stacks, inside a ``custom_vjp``: the inputs carry the
per-sequence initial states and ask for the final states (``cp_linear.gdp.GDPInputs``).

A packed batch (``cu_seqlens`` or ``seq_idx``) is laid out by ``cp_linear.chunking``: every
sequence starts a chunk, and the number of chunk slots is a static bound of T and N, so new
lengths with the same N reuse the compiled program.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cp_linear.chunking import cu_seqlens_from_seq_idx
from cp_linear.gdp import GDPInputs, cu_seqlens_error
from cp_linear.plan import validate_global_seq_idx
from cp_linear.protocol import CPSavedContext
from cp_linear.summary import as_packed_array
from cp_linear.validation import (
    GDP_VALUE_CHECKS,
    NONFINITE,
    gdp_sequence_bad,
    gdp_token_poison,
    gdp_value_flags,
    nonfinite_rows,
    poison,
    sanitize,
    sequence_start_index,
)
from jax_api._checks import is_concrete, raise_failed_value_checks
from jax_api.gdp.chunk import JaxGDPBackend, check_gdp_inputs, host_value_or_none
from jax_api.gdp.isolation import contained_inputs

_PROTOCOL = ("cp_forward_prepare", "cp_forward_apply", "cp_backward_prepare", "cp_backward_apply")


def resolve_backend(backend, *, sequence_states: bool = False, q=None, k=None, v=None, num_householder: int = 1):
    """``backend``, checked for the four functions (and, for the one-device op, the sequence states of
    ``cp_linear.gdp.GDPInputs``). None picks one for ``q``, ``k``, ``v``: the CuTeDSL kernels
    (``jax_api.gdp.cutedsl.CuTeDSLGatedDeltaProductCPBackend``) where they run these inputs (a Hopper
    GPU as JAX's default backend, bf16/fp16, K and V in {64, 128}), else ``JaxGDPBackend()``."""
    if backend is None:
        if q is None:
            backend = JaxGDPBackend()
        else:
            from jax_api.gdp.cutedsl import auto_backend

            backend = auto_backend(q, k, v, num_householder)
    for method in _PROTOCOL:
        if not callable(getattr(backend, method, None)):
            raise ValueError(f"backend must implement the four-function CP protocol; "
                             f"{type(backend).__name__} has no {method}")
    if sequence_states and not getattr(backend, "supports_sequence_states", False):
        raise ValueError(f"the one-device op needs a backend with initial and final sequence states "
                         f"(cp_linear.gdp.GDPInputs); {type(backend).__name__} does not declare "
                         "supports_sequence_states")
    return backend


def gate_or_zeros(g, q) -> jax.Array:
    """``g`` as given, or zeros [B, T, H] float32 for no gate (``g=None``, as in flash-linear-attention)."""
    return jnp.zeros(q.shape[:3], jnp.float32) if g is None else g


@jax.tree_util.register_pytree_node_class
class Residuals:
    """A backend's CPSavedContext plus extra arrays, as a pytree (metadata as static aux)."""

    def __init__(self, tensors: tuple, metadata: tuple, extra=()):
        self.tensors, self.metadata, self.extra = tensors, metadata, extra

    @classmethod
    def of(cls, saved: CPSavedContext, extra=()) -> "Residuals":
        return cls(tuple(saved.tensors), tuple(sorted(saved.metadata.items())), extra)

    def tree_flatten(self):
        return (self.tensors, self.extra), self.metadata

    @classmethod
    def tree_unflatten(cls, metadata, children):
        return cls(children[0], metadata, children[1])

    def saved_context(self) -> CPSavedContext:
        return CPSavedContext(tensors=tuple(self.tensors), metadata=dict(self.metadata))


def empty_stack(summary) -> jax.Array:
    """[0, ...] neighbour summaries shaped like ``summary`` (no rank before or after)."""
    packed = as_packed_array(summary)
    return jnp.zeros((0, *packed.shape), packed.dtype)


# --------------------------------------------------------------------------- the custom_vjp

_NONDIFF = ("backend", "scale", "num_householder", "use_qk_l2norm_in_kernel")


@functools.partial(jax.custom_vjp, nondiff_argnames=_NONDIFF)
def _one_device(q, k, v, g, beta, cu_seqlens, initial_state, token_flags, backend, scale, num_householder,
                use_qk_l2norm_in_kernel):
    # the primal runs only where no gradient is taken: the backend may keep nothing for a backward
    outputs, _ = _forward(q, k, v, g, beta, cu_seqlens, initial_state, token_flags, backend, scale, num_householder,
                          use_qk_l2norm_in_kernel, save_for_backward=False)
    return outputs


def _one_device_fwd(q, k, v, g, beta, cu_seqlens, initial_state, token_flags, backend, scale, num_householder,
                    use_qk_l2norm_in_kernel):
    return _forward(q, k, v, g, beta, cu_seqlens, initial_state, token_flags, backend, scale, num_householder,
                    use_qk_l2norm_in_kernel, save_for_backward=True)


def _forward(q, k, v, g, beta, cu_seqlens, initial_state, token_flags, backend, scale, num_householder,
             use_qk_l2norm_in_kernel, *, save_for_backward: bool):
    inputs = GDPInputs(q, k, v, g, beta, scale, num_householder, use_qk_l2norm_in_kernel, cu_seqlens,
                       initial_state, output_final_state=True, save_for_backward=save_for_backward,
                       token_flags=token_flags)
    if not save_for_backward and hasattr(backend, "one_device_forward"):
        # the primal (no gradient follows): the backend's one-device plan (the kernels' leaner inference plan)
        output, final_state, _ = backend.one_device_forward(inputs, initial_state)
        return (output, final_state), None
    summary, local = backend.cp_forward_prepare(inputs)
    (output, final_state), saved = backend.cp_forward_apply(local, empty_stack(summary))
    return (output, final_state), Residuals.of(saved)


def _one_device_bwd(backend, scale, num_householder, use_qk_l2norm_in_kernel, residuals: Residuals, cotangents):
    summary, context = backend.cp_backward_prepare(cotangents, residuals.saved_context())
    grads = backend.cp_backward_apply(context, empty_stack(summary))
    return (*grads[:5], None, grads.dinitial_state, None)  # cu_seqlens, token_flags: integer metadata


_one_device.defvjp(_one_device_fwd, _one_device_bwd)


# --------------------------------------------------------------------------- the public op


def _packed_cu_seqlens(cu_seqlens, seq_idx, tokens: int, initial_state) -> jax.Array:
    """int32 [N + 1] token offsets of the packed sequences (N static), validating concrete values."""
    if cu_seqlens is not None and seq_idx is not None:
        raise ValueError("pass cu_seqlens or seq_idx, not both")
    if cu_seqlens is not None:
        if isinstance(cu_seqlens, (list, tuple)):
            cu_seqlens = np.asarray(cu_seqlens)
        if getattr(cu_seqlens, "ndim", None) != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be int [N + 1] with N ≥ 1; received shape "
                             f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
        if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            raise ValueError(f"cu_seqlens must hold integers; received dtype {cu_seqlens.dtype}")
        cu = host_value_or_none(cu_seqlens)
        error = None if cu is None else cu_seqlens_error(cu.tolist(), tokens)
        if error:
            raise ValueError(error)
        return jnp.asarray(cu_seqlens, jnp.int32)
    if tuple(getattr(seq_idx, "shape", ())) != (1, tokens):
        raise ValueError(f"seq_idx must have shape [1, T] = (1, {tokens}); received "
                         f"{tuple(getattr(seq_idx, 'shape', ()))}")
    host_ids = host_value_or_none(seq_idx)
    if host_ids is not None:
        ids = validate_global_seq_idx(host_ids, 1)
        count = int(np.count_nonzero(np.diff(ids))) + 1
    elif initial_state is not None:
        count = initial_state.shape[0]
    else:
        raise ValueError("a traced seq_idx does not fix the number of sequences N: pass cu_seqlens, a concrete "
                         "seq_idx, or initial_state [N, H, K, V]")
    return cu_seqlens_from_seq_idx(jnp.asarray(seq_idx)[0], count)


_INITIAL_STATE_CHECK = (("initial_state", NONFINITE + " in initial_state"),)


def _value_flags(q, k, v, g, beta, initial_state=None):
    flags = gdp_value_flags(q, k, v, g, beta)
    if initial_state is not None:
        flags.append(~jnp.all(jnp.isfinite(initial_state)))
    return flags


def gated_delta_product(q, k, v, g, beta, *, scale: float | None = None, num_householder: int = 1,
                        cu_seqlens=None, seq_idx=None, initial_state=None, use_qk_l2norm_in_kernel: bool = False,
                        backend: Any = None, check_inputs: bool = True):
    """Gated DeltaProduct on one device (docs/design.md §2), differentiable.

    q [B, T, H, K], k [B, T*n_h, H, K], v [B, T*n_h, H, V], g [B, T, H] (log decay; None = no
    gate), beta [B, T*n_h, H]. Packed batch (B = 1): ``cu_seqlens`` int [N + 1], nondecreasing
    (empty sequences keep their initial state), or ``seq_idx`` int [1, T] (nondecreasing ids; a
    traced one needs ``initial_state`` to fix N); otherwise each row is one sequence (N = B).
    initial_state [N, H, K, V] (zeros when None).
    Returns (o [B, T, H, V] in q's dtype, final_state float32 [N, H, K, V]). ``backend``: any
    backend of the four-function protocol with sequence states; None picks the CuTeDSL kernels on a
    Hopper GPU for bf16/fp16 inputs with K, V in {64, 128}, else ``JaxGDPBackend()``
    (``resolve_backend``). K ≤ 256, V ≤ 512.

    check_inputs: with concrete (not traced) inputs, NaN/Inf (inputs, initial_state), g > 0 and
    beta outside [0, 2] raise ValueError (one host read). Traced inputs cannot be read; there, as
    with False, non-finite values are contained: the outputs and final states that depend on them
    are NaN and the rest exact (always on: bitwise no-op for finite inputs; docs/failure_modes.md).
    """
    g = gate_or_zeros(g, q)
    check_gdp_inputs(q, k, v, g, beta, num_householder)
    backend = resolve_backend(backend, sequence_states=True, q=q, k=k, v=v, num_householder=num_householder)
    batch, tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    scale = key_dim**-0.5 if scale is None else float(scale)
    packed = cu_seqlens is not None or seq_idx is not None
    if packed and batch != 1:
        raise ValueError(f"cu_seqlens / seq_idx describe one packed row: B must be 1; received B = {batch}")
    cu = _packed_cu_seqlens(cu_seqlens, seq_idx, tokens, initial_state) if packed else None
    count = cu.shape[0] - 1 if packed else batch
    if initial_state is not None and tuple(initial_state.shape) != (count, heads, key_dim, value_dim):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(count, heads, key_dim, value_dim)}; "
                         f"received {tuple(initial_state.shape)}")
    if check_inputs and is_concrete(q, k, v, g, beta, initial_state):
        checks = GDP_VALUE_CHECKS + (_INITIAL_STATE_CHECK if initial_state is not None else ())
        raise_failed_value_checks(checks, _value_flags, q, k, v, g, beta,
                                  *(() if initial_state is None else (initial_state,)), what="gated_delta_product")
    # containment (cp_linear.validation): sanitised inputs, NaN by selection where an output depends on one
    q, k, v, g, beta = (jnp.asarray(x) for x in (q, k, v, g, beta))
    state_bad, read_bad, inputs, token_flags = contained_inputs(q, k, v, g, beta, num_householder, backend=backend)
    start = sequence_start_index(cu, tokens) if packed else jnp.zeros((tokens,), jnp.int32)
    poisoned = gdp_token_poison(state_bad, read_bad, start)
    final_bad = gdp_sequence_bad(state_bad, cu)
    if initial_state is None:
        initial_state = jnp.zeros((count, heads, key_dim, value_dim), jnp.float32)
    else:
        initial_state = jnp.asarray(initial_state)
        initial_bad = nonfinite_rows(initial_state, 2)  # [N, H]
        final_bad = final_bad | initial_bad
        sequence = jnp.searchsorted(cu[1:], jnp.arange(tokens), side="right",
                                    method="scan_unrolled") if packed else None  # no while loop
        poisoned = poisoned | (initial_bad[sequence][None] if packed else initial_bad[:, None, :])
        initial_state = sanitize(initial_state)
    if token_flags is not None:
        # every poisoned token as read_bad: the backend stores their outputs as NaN and passes their output
        # gradient as zero itself (GDPInputs.token_flags), so no select over o and dO follows
        token_flags = (token_flags[0], poisoned.astype(jnp.uint8))
    output, final_state = _one_device(*inputs, cu, initial_state, token_flags, backend=backend, scale=scale,
                                      num_householder=num_householder,
                                      use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel))
    if token_flags is None:
        output = poison(output, poisoned[..., None])
    return output, poison(final_state, final_bad[..., None, None])


__all__ = ["Residuals", "empty_stack", "gate_or_zeros", "gated_delta_product", "resolve_backend"]
