"""Chunkwise CP for GDP in the zig-zag layout (``cp_linear.zigzag``) inside ``jax.shard_map``.

Rank r holds chunks r and 2·cp−1−r of 2·cp equal chunks (local order), each a *virtual shard* of a
contiguous 2·cp-way split: its metadata is the contiguous layout's for shard c of 2·cp
(``jax_api.gdp.cp.shard_metadata`` on the replicated ids, c traced). The backend runs once per
chunk, unchanged; the exchange is the contiguous all-gather over 2·cp virtual shards, as in torch
(``torch_api.gdp.zigzag``)::

    rank r:  prepare chunk r, prepare chunk 2cp-1-r   (zero incoming state)
             -> one all_gather of the pair [2, (B,) H, K, V + K]      -> [cp, 2, ...]
             -> sequence order (cp_linear.zigzag.gathered_chunk_order)  -> [s_0, ..., s_{2cp-1}]
             -> per chunk c: apply with the fold of [s_start .. s_{c-1}] (start from its metadata)

The backward is the same with ``[gamma | M^T]`` folded descending over ``[c + 1, stop)``. Folds mask
instead of slicing (static shapes), so one compiled program serves every packing. Non-finite inputs
are contained per chunk as in the contiguous layout (``cp_linear.validation``): a chunk whose trailing
fragment holds one sends a NaN summary, and the chunks its sequence continues into poison their first
sequence. Not supported (ValueError at trace time, the torch messages): sequence states and the scan
exchange (``cp_linear.zigzag.zigzag_gdp_option_error``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cp_linear.gdp import GDPInputs
from cp_linear.summary import as_packed_array
from cp_linear.validation import gdp_token_poison, gdp_trailing_bad, poison
from cp_linear.zigzag import gathered_chunk_order, zigzag_gdp_option_error
from jax_api._chunks import local_chunks
from jax_api.gdp.cp import incoming_state_summary, outgoing_grad_summary, poisoned_summary, shard_metadata
from jax_api.gdp.isolation import contained_inputs
from jax_api.gdp.ops import Residuals

_NONDIFF = ("axis_name", "backend", "scale", "num_householder", "use_qk_l2norm_in_kernel")


def _halves(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, 2·C·m, ...] -> the two chunks' [B, C·m, ...] (m = 1, or n_h for k, v, beta)."""
    half = x.shape[1] // 2
    return x[:, :half], x[:, half:]


def _in_sequence_order(stacked: jax.Array, axis_name: str) -> jax.Array:
    """Every rank's per-chunk pair [2, ...] -> the 2·cp chunks' items in sequence order [2·cp, ...]."""
    cp_size = jax.lax.axis_size(axis_name)
    gathered = jax.lax.all_gather(stacked, axis_name).reshape(-1, *stacked.shape[1:])  # rank-major
    return jnp.take(gathered, jnp.asarray(gathered_chunk_order(cp_size, "zigzag")), axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnames=_NONDIFF)
def _zigzag_context_parallel(q, k, v, g, beta, cu_seqlens, ranges, trailing_bad, axis_name, backend, scale,
                             num_householder, use_qk_l2norm_in_kernel):
    outputs, _ = _zigzag_fwd(q, k, v, g, beta, cu_seqlens, ranges, trailing_bad, axis_name, backend, scale,
                             num_householder, use_qk_l2norm_in_kernel)
    return outputs


def _zigzag_fwd(q, k, v, g, beta, cu_seqlens, ranges, trailing_bad, axis_name, backend, scale, num_householder,
                use_qk_l2norm_in_kernel):
    """Returns ((output [B, L, H, V], incoming_bad bool [2, B or 1, H]), residuals). ``cu_seqlens`` int32
    [2, N + 1] per chunk (None for batch rows); ``ranges`` int32 [2, 3] per chunk (chunk index,
    preceding_rank_start, following_rank_stop) in chunk units; ``trailing_bad`` bool [2, B or 1, H]."""
    prepared = [backend.cp_forward_prepare(GDPInputs(*parts, scale, num_householder, use_qk_l2norm_in_kernel, cu))
                for *parts, cu in zip(*map(_halves, (q, k, v, g, beta)), (None, None) if cu_seqlens is None
                                      else cu_seqlens)]
    summaries = jnp.stack([poisoned_summary(summary, bad) for (summary, _), bad in zip(prepared, trailing_bad)])
    outputs, saved, incoming_bad = [], [], []
    with jax.default_matmul_precision("highest"):  # float32 folds on GPUs too (no TF32), as torch
        ordered = _in_sequence_order(summaries, axis_name)
        for (_, local), (chunk, preceding_start, _) in zip(prepared, ranges):
            preceding, bad = incoming_state_summary(ordered, preceding_start, chunk)
            output, chunk_saved = backend.cp_forward_apply(local, preceding)
            outputs.append(output)
            saved.append(Residuals.of(chunk_saved))
            incoming_bad.append(bad.reshape(-1, bad.shape[-1]))
    return (jnp.concatenate(outputs, axis=1), jnp.stack(incoming_bad)), (tuple(saved), ranges)


def _zigzag_bwd(axis_name, backend, scale, num_householder, use_qk_l2norm_in_kernel, residuals, cotangents):
    output_grad, _ = cotangents  # incoming_bad is boolean: no cotangent
    saved, ranges = residuals
    prepared = [backend.cp_backward_prepare(grad, chunk_saved.saved_context())
                for grad, chunk_saved in zip(_halves(output_grad), saved)]
    grads = []
    with jax.default_matmul_precision("highest"):
        ordered = _in_sequence_order(jnp.stack([as_packed_array(summary) for summary, _ in prepared]), axis_name)
        for (_, context), (chunk, _, following_stop) in zip(prepared, ranges):
            grads.append(backend.cp_backward_apply(context, outgoing_grad_summary(ordered, chunk + 1, following_stop)))
    joined = [jnp.concatenate(parts, axis=1) for parts in zip(*(chunk_grads[:5] for chunk_grads in grads))]
    return (*joined, None, None, None)  # cu_seqlens, ranges, poison marks: integers


_zigzag_context_parallel.defvjp(_zigzag_fwd, _zigzag_bwd)


def check_zigzag_options(summary_exchange: str, with_states: bool) -> None:
    """Raise torch's ValueError for what the zig-zag op does not support (``summary_exchange`` resolved)."""
    # JAX contains non-finite values per chunk, so check_inputs=False (torch's third case) is supported
    error = zigzag_gdp_option_error(summary_exchange, with_states, check_inputs=True)
    if error:
        raise ValueError(error)


def zigzag_gdp_shard(q, k, v, g, beta, *, axis_name: str, global_seq_idx, max_sequences: int | None, scale: float,
                     num_householder: int, use_qk_l2norm_in_kernel: bool, backend, summary_exchange: str,
                     with_states: bool):
    """``gdp_chunkwise_context_parallel_shard(..., layout="zigzag")`` after its shared checks (inputs,
    backend, the ids' shape; ``summary_exchange`` resolved): per-chunk metadata and containment, then
    the op. Call inside ``jax.shard_map``; q [B, L, H, K] etc. hold chunks r and 2·cp−1−r."""
    check_zigzag_options(summary_exchange, with_states)
    local_len = q.shape[1]
    if local_len % 2:
        raise ValueError(f"layout='zigzag' holds two equal chunks per rank: the local length must be even; "
                         f"received {local_len}")
    cp_size, chunk_len = jax.lax.axis_size(axis_name), local_len // 2
    chunks = local_chunks(axis_name, "zigzag")  # [2]: this rank's chunks, local order
    cu_seqlens, preceding_starts, following_stops, starts = zip(*(
        shard_metadata(global_seq_idx, chunk, chunk_len, 2 * cp_size, max_sequences) for chunk in chunks))
    ranges = jnp.stack([chunks, jnp.stack(preceding_starts), jnp.stack(following_stops)], axis=1).astype(jnp.int32)
    # containment (cp_linear.validation) per chunk, as the contiguous layout per shard
    *flags, clean, _ = contained_inputs(q, k, v, g, beta, num_householder, backend=backend, copies=True)
    state_bad, read_bad = (_halves(chunk_flags) for chunk_flags in flags)
    trailing_bad = jnp.stack([gdp_trailing_bad(bad, start) for bad, start in zip(state_bad, starts)])
    output, incoming_bad = _zigzag_context_parallel(
        *clean, None if global_seq_idx is None else jnp.stack(cu_seqlens), ranges,
        trailing_bad, axis_name=axis_name, backend=backend, scale=scale, num_householder=num_householder,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    poisoned = [gdp_token_poison(*chunk_flags) for chunk_flags in zip(state_bad, read_bad, starts, incoming_bad)]
    return poison(output, jnp.concatenate(poisoned, axis=1)[..., None])


__all__ = ["check_zigzag_options", "zigzag_gdp_shard"]
