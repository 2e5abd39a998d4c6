"""One-device Gated DeltaProduct in JAX: ``gated_delta_product`` -> (o, final_state), differentiable.

Mirrors ``cp_linear.reference.naive_gated_delta_product`` (naive form: ``jax_api.gdp.naive``),
computed by the chunked WY/UT algorithm of ``jax_api.gdp.chunk`` and differentiated by JAX.

A packed batch (``cu_seqlens`` or ``seq_idx``) is laid out so that every sequence starts on a
chunk boundary: each chunk then holds one sequence, a sequence starts from its own initial
state, and its final state is the state after its last chunk. The layout is computed on device
with a static bound on the number of chunks (``S // C + N`` for S steps, N sequences), so new
lengths with the same N reuse the compiled program::

    steps     a a a a a b b | c c c c c c c c c c        (C = 4)
    chunks    [a a a a][a . . .][b b . .][c c c c][c c c c][c c . .]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cp_linear.plan import validate_global_seq_idx
from cp_linear.validation import (
    GDP_VALUE_CHECKS,
    NONFINITE,
    gdp_bad_tokens,
    gdp_sequence_bad,
    gdp_token_poison,
    gdp_value_flags,
    nonfinite_rows,
    poison,
    sanitize,
    sequence_start_index,
)
from jax_api._checks import is_concrete, raise_failed_value_checks
from jax_api.gdp.chunk import (
    ChunkRestarts,
    JaxGDPBackend,
    JaxGDPInputs,
    StepInputs,
    check_gdp_inputs,
    host_value_or_none,
    chunk_outputs,
    chunk_start_states,
    chunk_terms,
    step_layout,
    token_outputs,
)


def _packed_lengths(cu_seqlens, seq_idx, tokens: int, initial_state) -> jax.Array:
    """Lengths int32 [N] of the packed sequences (N static), validating concrete descriptions."""
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
        if cu is not None and (cu[0] != 0 or cu[-1] != tokens or np.any(np.diff(cu) <= 0)):
            raise ValueError(f"cu_seqlens must rise strictly from 0 to T = {tokens}; received {cu.tolist()}")
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        return cu[1:] - cu[:-1]
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
    ids = jnp.asarray(seq_idx)[0]
    run = jnp.cumsum(jnp.concatenate([jnp.zeros((1,), jnp.int32), (ids[1:] != ids[:-1]).astype(jnp.int32)]))
    return jax.ops.segment_sum(jnp.ones((tokens,), jnp.int32), run, num_segments=count)


def _one_sequence_per_chunk(steps: StepInputs, lengths: jax.Array, num_householder: int, chunk_size: int):
    """Gather the steps into a buffer where each sequence starts a chunk.

    Returns (buffered steps, destination of every step [S], first chunk [N], last chunk [N]).
    """
    num_steps = steps.k.shape[2]
    count = lengths.shape[0]
    step_lengths = lengths * num_householder
    chunks = -(-step_lengths // chunk_size)
    first_chunk = jnp.cumsum(chunks) - chunks
    first_step = jnp.cumsum(step_lengths) - step_lengths
    sequence_of_step = jnp.searchsorted(jnp.cumsum(step_lengths), jnp.arange(num_steps), side="right")
    sequence_of_step = jnp.minimum(sequence_of_step, count - 1)
    destination = first_chunk[sequence_of_step] * chunk_size + jnp.arange(num_steps) - first_step[sequence_of_step]
    buffer_chunks = min(num_steps, num_steps // chunk_size + count)
    # slot -> source step; slots past a sequence's end read a zero (identity) step
    source = jnp.full((buffer_chunks * chunk_size,), num_steps, jnp.int32).at[destination].set(
        jnp.arange(num_steps, dtype=jnp.int32), unique_indices=True)

    def gather(x):
        padded = jnp.concatenate([x, jnp.zeros_like(x[:, :, :1])], axis=2)
        return jnp.take(padded, source, axis=2)

    buffered = StepInputs(*(gather(x) for x in steps[:5]), resets=None)
    return buffered, destination, first_chunk, first_chunk + chunks - 1


_INITIAL_STATE_CHECK = (("initial_state", NONFINITE + " in initial_state"),)


def _value_flags(q, k, v, g, beta, initial_state=None):
    flags = gdp_value_flags(q, k, v, g, beta)
    if initial_state is not None:
        flags.append(~jnp.all(jnp.isfinite(initial_state)))
    return flags


def gated_delta_product(q, k, v, g, beta, *, scale: float | None = None, num_householder: int = 1,
                        cu_seqlens=None, seq_idx=None, initial_state=None, use_qk_l2norm_in_kernel: bool = False,
                        backend: Any = None, check_inputs: bool = True):
    """Gated DeltaProduct on one device (DESIGN.md §2).

    q [B, T, H, K], k [B, T*n_h, H, K], v [B, T*n_h, H, V], g [B, T, H], beta [B, T*n_h, H].
    Packed batch (B = 1): ``cu_seqlens`` int [N + 1] or ``seq_idx`` int [1, T] (nondecreasing
    ids; a traced one needs ``initial_state`` to fix N); otherwise each row is one sequence
    (N = B). initial_state [N, H, K, V] (zeros when None).
    Returns (o [B, T, H, V] in q's dtype, final_state float32 [N, H, K, V]). ``backend``: a
    ``JaxGDPBackend`` (its ``chunk_size`` is used); None means ``JaxGDPBackend()``. K ≤ 256, V ≤ 512.

    check_inputs: with concrete (not traced) inputs, NaN/Inf (inputs, initial_state), g > 0 and
    beta outside [0, 2] raise ValueError (one host read). Traced inputs cannot be read; there, as
    with False, non-finite values are contained: the outputs and final states that depend on them
    are NaN and the rest exact (always on: bitwise no-op for finite inputs).
    """
    check_gdp_inputs(q, k, v, g, beta, num_householder)
    backend = JaxGDPBackend() if backend is None else backend
    if not isinstance(backend, JaxGDPBackend):
        raise ValueError(f"the one-device op runs the pure-JAX algorithm: backend must be a JaxGDPBackend; "
                         f"received {type(backend).__name__}")
    batch, tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    scale = key_dim**-0.5 if scale is None else float(scale)
    packed = cu_seqlens is not None or seq_idx is not None
    if packed and batch != 1:
        raise ValueError(f"cu_seqlens / seq_idx describe one packed row: B must be 1; received B = {batch}")
    lengths = _packed_lengths(cu_seqlens, seq_idx, tokens, initial_state) if packed else None
    count = lengths.shape[0] if packed else batch
    if initial_state is not None and tuple(initial_state.shape) != (count, heads, key_dim, value_dim):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(count, heads, key_dim, value_dim)}; "
                         f"received {tuple(initial_state.shape)}")
    if check_inputs and is_concrete(q, k, v, g, beta, initial_state):
        checks = GDP_VALUE_CHECKS + (_INITIAL_STATE_CHECK if initial_state is not None else ())
        raise_failed_value_checks(checks, _value_flags, q, k, v, g, beta,
                                  *(() if initial_state is None else (initial_state,)), what="gated_delta_product")
    # containment (cp_linear.validation): sanitised inputs, NaN by selection where an output depends on one
    q, k, v, g, beta = (jnp.asarray(x) for x in (q, k, v, g, beta))
    state_bad, read_bad = gdp_bad_tokens(q, k, v, g, beta, num_householder)
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths)]) if packed else None
    start = sequence_start_index(cu, tokens) if packed else jnp.zeros((tokens,), jnp.int32)
    poisoned = gdp_token_poison(state_bad, read_bad, start)
    final_bad = gdp_sequence_bad(state_bad, cu)
    if initial_state is None:
        initial_state = jnp.zeros((count, heads, key_dim, value_dim), jnp.float32)
    else:
        initial_state = jnp.asarray(initial_state)
        initial_bad = nonfinite_rows(initial_state, 2)  # [N, H]
        final_bad = final_bad | initial_bad
        sequence = jnp.searchsorted(cu[1:], jnp.arange(tokens), side="right") if packed else None
        poisoned = poisoned | (initial_bad[sequence][None] if packed else initial_bad[:, None, :])
        initial_state = sanitize(initial_state)
    q, k, v, g, beta = (sanitize(x) for x in (q, k, v, g, beta))
    output, final_state = _gated_delta_product(q, k, v, g, beta, lengths, initial_state.astype(jnp.float32), scale,
                                               num_householder, bool(use_qk_l2norm_in_kernel), backend)
    return poison(output, poisoned[..., None]), poison(final_state, final_bad[..., None, None])


def _gated_delta_product(q, k, v, g, beta, lengths, initial_state, scale, num_householder, use_qk_l2norm_in_kernel,
                         backend):
    tokens = q.shape[1]
    packed = lengths is not None
    count = lengths.shape[0] if packed else q.shape[0]
    inputs = JaxGDPInputs(q, k, v, g, beta, scale=scale, num_householder=num_householder,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    steps = step_layout(inputs)
    if not packed:
        terms = chunk_terms(steps, backend.chunk_size)
        states, final_state = chunk_start_states(terms, initial_state)
        output = token_outputs(chunk_outputs(terms, states, scale), tokens, num_householder)
        return output.astype(q.dtype), final_state

    buffered, destination, first_chunk, last_chunk = _one_sequence_per_chunk(
        steps, lengths, num_householder, backend.chunk_size)
    terms = chunk_terms(buffered, backend.chunk_size)
    num_chunks = terms.update.shape[2]
    restarts = ChunkRestarts(
        flags=jnp.zeros((num_chunks,), bool).at[first_chunk].set(True),
        index=jnp.zeros((num_chunks,), jnp.int32).at[first_chunk].set(jnp.arange(count, dtype=jnp.int32)),
        states=initial_state[:, None],
    )
    states, _ = chunk_start_states(terms, jnp.zeros_like(initial_state[:1]), restarts)
    step_outputs = jnp.take(chunk_outputs(terms, states, scale), destination, axis=2)
    output = token_outputs(step_outputs, tokens, num_householder)
    # final state of a sequence: its last chunk applied to the state entering that chunk
    ends = jnp.einsum("hnkl,hnlv->nhkv", terms.transition[0][:, last_chunk], states[0][:, last_chunk],
                      precision=jax.lax.Precision.HIGHEST) + jnp.moveaxis(terms.update[0][:, last_chunk], 1, 0)
    return output.astype(q.dtype), ends
