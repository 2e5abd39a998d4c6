"""Chunkwise context parallelism for Gated DeltaProduct in JAX: shard_map, all_gather / ppermute, custom_vjp.

The packed sequence is split contiguously along T over one mesh axis (``cp``); rank r owns
tokens [r L, (r+1) L). One all-gather per direction moves the float32 summaries (or, with
``summary_exchange="scan"``, ceil(log2 cp) ppermute rounds fold them: ``jax_api.gdp.summary_exchange``)::

    forward:  summary_r = [E | M] of rank r          (backend.cp_forward_prepare, zero state)
              gathered  = all_gather(summary)         [cp, H, K, V + K]
              S_in      = fold gathered[preceding_rank_start:r] ascending
              output    = backend.cp_forward_apply(local, [S_in | 0])
    backward: summary_r = [gamma | M^T]               (backend.cp_backward_prepare, zero dS_out)
              dS_out    = fold gathered[r+1:following_rank_stop] descending
              grads     = backend.cp_backward_apply(ctx, [dS_out | 0])

Everything is computed on device inside the traced program: rank r is ``axis_index``, and the
per-shard metadata (the local ``cu_seqlens``, preceding_rank_start, following_rank_stop) comes
from the replicated ``global_seq_idx`` with static shapes (``cp_linear.chunking`` and
``cp_linear.plan``, array-API code shared with the host path), so one compiled program serves every
packing whose shards hold at most ``max_sequences`` sequences. The folds mask ranks outside their
range instead of slicing (``cp_linear.summary.compose_forward_range``); the backend receives the
folded state as one summary ``[S | 0]`` (M = 0, E = S), whose fold is S again.

Worked example: lengths [5, 4, 7], cp = 4 (L = 4)::

    token    0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15
    seq id   0 0 0 0 | 0 1 1 1 | 1 2  2  2 |  2  2  2  2
    rank 1: cu_seqlens [0, 1, 4, 4, 4] (max_sequences 4: two empty sequences at the end),
            S_in = fold(ranks [0, 1)), dS_out = fold(ranks [2, 3))

``max_sequences`` (static) bounds the sequences of one shard: the chunk layout has
``(S + 63 N) // 64`` slots for S = L * n_h steps, so a tight bound saves memory. It is read from
the ids when they are concrete (rounded up to a power of two, so that packings share programs);
traced ids need it passed, else the bound is L (every token its own sequence), which is always
correct but makes the chunk buffers up to 64 / n_h times larger.

``layout="zigzag"`` (rank r holds chunks r and 2·cp−1−r, ``cp_linear.zigzag``) runs the same steps
per chunk, with each chunk a shard of a 2·cp-way split: ``jax_api.gdp.zigzag``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from cp_linear.chunking import cu_seqlens_from_seq_idx, max_shard_sequences
from cp_linear.gdp import GDPInputs
from cp_linear.plan import inner_sequence_ranks, sequence_rank_range, validate_global_seq_idx
from cp_linear.summary import (
    as_packed_array,
    compose_backward_range,
    compose_forward_range,
    fold_forward_range_summary,
    split_packed,
)
from cp_linear.summary_exchange import SUMMARY_EXCHANGES, resolve_summary_exchange
from cp_linear.zigzag import check_layout, chunk_length
from cp_linear.validation import (
    GDP_VALUE_CHECKS,
    gdp_token_poison,
    gdp_trailing_bad,
    gdp_value_flags,
    nonfinite_rows,
    poison,
    sequence_start_index,
)
from jax_api._checks import is_concrete, raise_failed_value_checks
from jax_api._mesh import place, run_mesh
from jax_api.gdp.chunk import check_gdp_inputs, host_value_or_none
from jax_api.gdp.isolation import contained_inputs
from jax_api.gdp.ops import Residuals, gate_or_zeros, resolve_backend
from jax_api.gdp.summary_exchange import scan_fold

_NONDIFF = ("axis_name", "backend", "scale", "num_householder", "use_qk_l2norm_in_kernel", "output_final_state",
            "summary_exchange")


# --------------------------------------------------------------------------- the custom_vjp core


def _as_single_summary(state: jax.Array) -> jax.Array:
    """State [..., K, V] -> stacked summary [1, ..., K, V + K] = [state | 0] (its fold is the state)."""
    key_dim = state.shape[-2]
    zeros = jnp.zeros((*state.shape[:-1], key_dim), state.dtype)
    return jnp.concatenate([state, zeros], axis=-1)[None]


def poisoned_summary(summary, trailing_bad: jax.Array) -> jax.Array:
    """A prepared summary as the packed array [(B,) H, K, V + K], NaN in the heads whose trailing fragment
    holds a non-finite input (``trailing_bad`` bool [B or 1, H])."""
    packed_summary = as_packed_array(summary)
    marks = trailing_bad.reshape(*trailing_bad.shape[packed_summary.ndim == 3:], 1, 1)
    return poison(packed_summary, marks)


def incoming_state_summary(gathered: jax.Array, start, stop) -> tuple[jax.Array, jax.Array]:
    """Fold ``gathered[start:stop]`` ascending into the incoming state; returns it as the one summary
    ``[S | 0]`` [1, (B,) H, K, V + K] the backend applies, zero in the heads that came in non-finite, and
    those heads (``incoming_bad`` bool [(B,) H])."""
    incoming = compose_forward_range(gathered, start, stop)  # [(B,) H, K, V]
    incoming_bad = nonfinite_rows(incoming, 2)
    return _as_single_summary(jnp.where(incoming_bad[..., None, None], 0.0, incoming)), incoming_bad


def outgoing_grad_summary(gathered: jax.Array, start, stop) -> jax.Array:
    """Fold ``gathered[start:stop]`` descending into the outgoing state-gradient, as ``[dS | 0]``."""
    return _as_single_summary(compose_backward_range(gathered, start, stop))


@functools.partial(jax.custom_vjp, nondiff_argnames=_NONDIFF)
def _context_parallel(q, k, v, g, beta, local_initial, cu_seqlens, preceding_rank_start, following_rank_stop,
                      trailing_bad, scan_stops, token_flags, axis_name, backend, scale, num_householder,
                      use_qk_l2norm_in_kernel, output_final_state, summary_exchange):
    outputs, _ = _context_parallel_fwd(
        q, k, v, g, beta, local_initial, cu_seqlens, preceding_rank_start, following_rank_stop, trailing_bad,
        scan_stops, token_flags, axis_name=axis_name, backend=backend, scale=scale, num_householder=num_householder,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, output_final_state=output_final_state,
        summary_exchange=summary_exchange, save_for_backward=False)  # the primal: no gradient follows
    return outputs


def _context_parallel_fwd(q, k, v, g, beta, local_initial, cu_seqlens, preceding_rank_start, following_rank_stop,
                          trailing_bad, scan_stops, token_flags, axis_name, backend, scale, num_householder,
                          use_qk_l2norm_in_kernel, output_final_state, summary_exchange, save_for_backward=True):
    """Returns ((output, local final states or None, incoming_bad), residuals). ``local_initial``: the
    initial states of the local sequences [n, H, K, V] or None. ``trailing_bad`` bool [B or 1, H]: heads
    whose trailing fragment holds a non-finite input travel as NaN; ``incoming_bad`` (same shape) says
    which heads of the incoming state came in non-finite (they enter the backend as zeros).
    ``summary_exchange`` "all_gather" | "scan" (resolved); ``scan_stops`` bool [2]: the scan's folds
    stop at this rank (forward, backward; ``jax_api.gdp.summary_exchange``). ``token_flags``: the
    containment's flags for a backend that zeroes flagged rows (``GDPInputs.token_flags``), or None."""
    inputs = GDPInputs(q, k, v, g, beta, scale, num_householder, use_qk_l2norm_in_kernel, cu_seqlens,
                       local_initial, output_final_state, save_for_backward, token_flags)
    summary, local = backend.cp_forward_prepare(inputs)
    packed_summary = poisoned_summary(summary, trailing_bad)  # [(B,) H, K, V + K]
    rank = jax.lax.axis_index(axis_name)
    with jax.default_matmul_precision("highest"):  # float32 folds on GPUs too (no TF32), as torch
        if summary_exchange == "scan":  # the fold of [preceding_rank_start, rank), [0 | I] when empty
            folded = scan_fold(packed_summary, axis_name, stop=scan_stops[0], empty=preceding_rank_start == rank,
                               descending=False)
            incoming_bad = nonfinite_rows(folded, 2)
            folded = jnp.where(incoming_bad[..., None, None], 0.0, folded)
            # without initial states the backend needs only the state the fold makes from zero: E
            preceding = (_as_single_summary(split_packed(folded)[0]) if local_initial is None else folded[None])
        elif local_initial is None:  # the folded state travels as [S | 0]
            gathered = jax.lax.all_gather(packed_summary, axis_name)  # [cp, (B,) H, K, V + K]
            preceding, incoming_bad = incoming_state_summary(gathered, preceding_rank_start, rank)
        else:  # keep M: the backend folds it from the continuing sequence's initial state (M S0 + E)
            gathered = jax.lax.all_gather(packed_summary, axis_name)
            folded = fold_forward_range_summary(gathered, preceding_rank_start, rank)  # [(B,) H, K, V + K]
            incoming_bad = nonfinite_rows(folded, 2)
            preceding = jnp.where(incoming_bad[..., None, None], 0.0, folded)[None]
    output, saved = backend.cp_forward_apply(local, preceding)
    output, final = output if output_final_state else (output, None)
    incoming_bad = incoming_bad.reshape(-1, incoming_bad.shape[-1])
    return (output, final, incoming_bad), Residuals.of(saved, (following_rank_stop, scan_stops[1]))


def _context_parallel_bwd(axis_name, backend, scale, num_householder, use_qk_l2norm_in_kernel, output_final_state,
                          summary_exchange, residuals: Residuals, cotangents):
    output_grad, final_grad, _ = cotangents  # incoming_bad is boolean: no cotangent
    grads_in = (output_grad, final_grad) if output_final_state else output_grad
    summary, context = backend.cp_backward_prepare(grads_in, residuals.saved_context())
    following_rank_stop, backward_stop = residuals.extra
    rank = jax.lax.axis_index(axis_name)
    with jax.default_matmul_precision("highest"):
        if summary_exchange == "scan":  # fold of [rank + 1, following_rank_stop) descending; its gamma from zero
            folded = scan_fold(as_packed_array(summary), axis_name, stop=backward_stop,
                               empty=following_rank_stop == rank + 1, descending=True)
            following = _as_single_summary(split_packed(folded)[0])
        else:
            gathered = jax.lax.all_gather(as_packed_array(summary), axis_name)
            following = outgoing_grad_summary(gathered, rank + 1, following_rank_stop)
    grads = backend.cp_backward_apply(context, following)
    initial_grad = None if len(grads) < 6 else grads[5]
    # cu_seqlens, rank bounds, poison marks, scan stops, token flags: integers
    return (*grads[:5], initial_grad, None, None, None, None, None, None)


_context_parallel.defvjp(_context_parallel_fwd, _context_parallel_bwd)


# --------------------------------------------------------------------------- validation and metadata


def _axis_size(axis_name: str) -> int:
    try:
        return jax.lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"axis_name {axis_name!r} is not bound here: call gdp_chunkwise_context_parallel_shard inside a "
            f"jax.shard_map over a mesh with that axis (or use gdp_chunkwise_context_parallel)") from err


def _check_seq_idx_shape(global_seq_idx, batch: int, total: int) -> None:
    shape = tuple(getattr(global_seq_idx, "shape", ()))
    if shape != (1, total):
        raise ValueError(f"global_seq_idx must have shape [1, T] = (1, {total}); received {shape}")
    dtype = getattr(global_seq_idx, "dtype", None)
    if dtype is None or dtype == jnp.bool_ or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"global_seq_idx must hold integers; received dtype {dtype}")
    if batch != 1:
        raise ValueError(f"global_seq_idx describes one packed row: B must be 1; received B = {batch}")


def packed_shard_metadata(global_seq_idx: jax.Array, rank, local_len: int, max_sequences: int):
    """Per-shard metadata from the replicated ids int [1, T], on device with static shapes.

    Returns (local cu_seqlens int32 [max_sequences + 1], preceding_rank_start, following_rank_stop)
    with the meaning of ``cp_linear.plan.build_packed_sequence_cp_metadata``; sequences past the
    shard's last are empty.
    """
    ids = global_seq_idx[0]
    local = jax.lax.dynamic_slice_in_dim(ids, rank * local_len, local_len)
    preceding_rank_start, following_rank_stop = sequence_rank_range(ids, rank, local_len)
    return cu_seqlens_from_seq_idx(local, max_sequences), preceding_rank_start, following_rank_stop


def shard_metadata(global_seq_idx: jax.Array | None, shard, shard_len: int, shard_count: int,
                   max_sequences: int | None):
    """Metadata of shard ``shard`` (traced) of ``shard_count`` equal ones: a rank, or a zig-zag chunk as a
    virtual shard. Returns (local cu_seqlens int32 [bound + 1] or None for batch rows, preceding_rank_start,
    following_rank_stop, sequence start index int32 [shard_len]); ``max_sequences`` None bounds by the length."""
    if global_seq_idx is None:  # every batch row one sequence over all shards
        return None, jnp.int32(0), jnp.int32(shard_count), jnp.zeros((shard_len,), jnp.int32)
    bound = shard_len if max_sequences is None else _check_max_sequences(max_sequences, shard_len)
    cu_seqlens, preceding_rank_start, following_rank_stop = packed_shard_metadata(global_seq_idx, shard, shard_len,
                                                                                  bound)
    return cu_seqlens, preceding_rank_start, following_rank_stop, sequence_start_index(cu_seqlens, shard_len)


def local_sequence_rows(global_seq_idx: jax.Array | None, rank, local_len: int, cp_size: int, local_count: int,
                        num_sequences: int, preceding_rank_start, following_rank_stop):
    """Traced counterpart of ``cp_linear.plan.SequenceStateRouting`` for one shard, static shapes.

    Returns (rows int32 [local_count]: the global row of each local sequence, clipped to [0, N) for the
    empty padding sequences past the shard's last; ends_here bool [local_count]: the sequence is real and
    its last token lies on this rank; first_continues: bool scalar, the first local sequence began on an
    earlier rank). Sequence n is the n-th run of equal ids, or batch row n without ids.
    """
    if global_seq_idx is None:  # every batch row one sequence over all ranks
        rows = jnp.arange(local_count, dtype=jnp.int32)
        return rows, jnp.full((local_count,), rank == cp_size - 1), rank > 0
    ids = global_seq_idx[0]
    run = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum((ids[1:] != ids[:-1]).astype(jnp.int32))])
    first = jax.lax.dynamic_index_in_dim(run, rank * local_len, keepdims=False)
    last = jax.lax.dynamic_index_in_dim(run, (rank + 1) * local_len - 1, keepdims=False)
    index = jnp.arange(local_count, dtype=jnp.int32)
    rows = jnp.minimum(first + index, num_sequences - 1)
    real = index <= last - first
    ends_here = real & ((index < last - first) | (following_rank_stop == rank + 1))
    return rows, ends_here, preceding_rank_start < rank


def _resolve(q, k, v, num_householder, backend, scale):
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return resolve_backend(backend, q=q, k=k, v=v, num_householder=num_householder), scale


# --------------------------------------------------------------------------- public functions


def gdp_chunkwise_context_parallel_shard(q, k, v, g, beta, *, axis_name: str = "cp", global_seq_idx=None,
                                         max_sequences: int | None = None, scale: float | None = None,
                                         num_householder: int = 1, use_qk_l2norm_in_kernel: bool = False,
                                         backend: Any = None, initial_state=None, output_final_state: bool = False,
                                         num_sequences: int | None = None, summary_exchange: str = "all_gather",
                                         layout: str = "contiguous"):
    """Chunkwise-CP Gated DeltaProduct on one shard: call it *inside* your own ``jax.shard_map``.

    q [B, L, H, K], k [B, L*n_h, H, K], v [B, L*n_h, H, V], g [B, L, H], beta [B, L*n_h, H] are
    this rank's contiguous slice of T = L * cp tokens, where cp is the size of mesh axis
    ``axis_name``. ``global_seq_idx``: int [1, T], nondecreasing sequence ids of the whole packed
    row, *replicated* (in_spec ``P()``), with B = 1; None means every batch row is one sequence
    spanning all ranks. ``max_sequences`` (static): at most this many sequences touch one shard
    (None: L; see the module docstring). g may be None (no gate). Returns the local output
    [B, L, H, V] in q's dtype; differentiable (custom_vjp: one all-gather of [gamma | M^T]
    summaries in the backward).

    The ids cannot be checked here (they are traced), nor can values: shapes and sizes are checked;
    a non-finite input is contained (the outputs that depend on it are NaN, all others exact, on
    every rank). The global entry point checks concrete ids and values.
    ``backend``: any backend of the four-function protocol; None picks the CuTeDSL kernels on a
    Hopper GPU for bf16/fp16 inputs with K, V in {64, 128}, else ``JaxGDPBackend()``.

    Sequence states (docs/cp_options.md): ``initial_state`` float [N, H, K, V], replicated (in_spec
    ``P()``), row n for the n-th run of equal ids (batch row n without ids); it enters sequence n on
    the rank where it starts. With ``output_final_state=True`` returns ``(o, final_state)``, final_state
    float32 [N, H, K, V] holding this rank's rows (sequences whose last token is here) and zeros
    elsewhere: ``jax.lax.psum(final_state, axis_name)`` is the one-device final state. JAX sums the
    cotangents of a replicated input over the axis, so d initial_state is the one-device gradient.
    N is ``initial_state.shape[0]``, else ``num_sequences`` (required for final states without
    initial states and with ids; static).

    ``summary_exchange``: "all_gather" (one all-gather per direction, cp summaries held), "scan" (a
    log-depth prefix fold over ceil(log2 cp) ``ppermute`` rounds, ``jax_api.gdp.summary_exchange``)
    or "auto" (scan from ``SCAN_MIN_WORLD`` ranks, as torch); equal results up to float32
    reassociation (docs/cp_options.md).

    ``layout``: "contiguous" (above) or "zigzag": the shard holds chunks r and 2·cp−1−r of 2·cp equal
    chunks, in that order (``cp_linear.zigzag``; L even); ``global_seq_idx`` stays in sequence order and
    ``max_sequences`` bounds the sequences of one chunk. Sequence states and the scan exchange are not
    supported there (ValueError, as torch); ``jax_api.gdp.zigzag``.
    """
    cp_size = _axis_size(axis_name)
    exchange = _resolve_exchange(summary_exchange, cp_size)
    g = gate_or_zeros(g, q)
    check_gdp_inputs(q, k, v, g, beta, num_householder)
    backend, scale = _resolve(q, k, v, num_householder, backend, scale)
    batch, local_len = q.shape[:2]
    if global_seq_idx is not None:
        _check_seq_idx_shape(global_seq_idx, batch, local_len * cp_size)
    if check_layout(layout) == "zigzag":
        from jax_api.gdp.zigzag import zigzag_gdp_shard

        with_states = initial_state is not None or bool(output_final_state)
        return zigzag_gdp_shard(q, k, v, g, beta, axis_name=axis_name, global_seq_idx=global_seq_idx,
                                max_sequences=max_sequences, scale=scale, num_householder=num_householder,
                                use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel), backend=backend,
                                summary_exchange=exchange, with_states=with_states)
    cu_seqlens, preceding_rank_start, following_rank_stop, start = shard_metadata(
        global_seq_idx, jax.lax.axis_index(axis_name), local_len, cp_size, max_sequences)
    scan_stops = jnp.zeros((2,), bool)  # read by the scan only
    if exchange == "scan":
        rank = jax.lax.axis_index(axis_name)
        if global_seq_idx is None:  # every row starts on rank 0 and ends on the last rank
            scan_stops = jnp.stack([rank == 0, rank == cp_size - 1])
        else:
            trailing_start_rank, leading_end_rank = inner_sequence_ranks(global_seq_idx[0], rank, local_len)
            scan_stops = jnp.stack([trailing_start_rank == rank, leading_end_rank == rank])
    # containment (cp_linear.validation): sanitised inputs; a poisoned trailing fragment travels as NaN
    state_bad, read_bad, (q, k, v, g, beta), token_flags = contained_inputs(q, k, v, g, beta, num_householder,
                                                                           backend=backend)
    trailing_bad = gdp_trailing_bad(state_bad, start)
    local_initial = routing = None
    if initial_state is not None or output_final_state:
        sequences = _state_rows(initial_state, num_sequences, global_seq_idx, q, v)
        local_count = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
        routing = local_sequence_rows(global_seq_idx, jax.lax.axis_index(axis_name), local_len, cp_size, local_count,
                                      sequences, preceding_rank_start, following_rank_stop)
        if initial_state is not None:
            rows, _, first_continues = routing
            local_initial = jnp.take(initial_state, rows, axis=0)
            # a continuing first sequence folds the preceding summaries from its S0; its gradient is
            # counted where it starts (the backward summaries bring this rank's share there)
            continuing = (jnp.arange(local_count) < (local_count if cu_seqlens is None else 1)) & first_continues
            local_initial = jnp.where(continuing[:, None, None, None], jax.lax.stop_gradient(local_initial),
                                      local_initial)
    output, local_final, incoming_bad = _context_parallel(
        q, k, v, g, beta, local_initial, cu_seqlens, preceding_rank_start, following_rank_stop, trailing_bad,
        scan_stops, token_flags, axis_name=axis_name, backend=backend, scale=scale, num_householder=num_householder,
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel), output_final_state=bool(output_final_state),
        summary_exchange=exchange)
    output = poison(output, gdp_token_poison(state_bad, read_bad, start, incoming_bad)[..., None])
    if not output_final_state:
        return output
    rows, ends_here, _ = routing
    kept = jnp.where(ends_here[:, None, None, None], local_final, 0.0)
    final = jnp.zeros((sequences, *local_final.shape[1:]), jnp.float32).at[rows].add(kept)
    return output, final


def _state_rows(initial_state, num_sequences, global_seq_idx, q, v) -> int:
    """N of the sequence states (static), with the initial state's shape and dtype checked."""
    if initial_state is not None:
        shape = tuple(getattr(initial_state, "shape", ()))
        expected = (shape[0] if shape else -1, q.shape[2], q.shape[3], v.shape[3])
        if len(shape) != 4 or shape != expected or (num_sequences is not None and shape[0] != num_sequences):
            rows = "N" if num_sequences is None else num_sequences
            raise ValueError(f"initial_state must be [N, H, K, V] = ({rows}, {q.shape[2]}, {q.shape[3]}, "
                             f"{v.shape[3]}) (one row per global sequence, replicated); received {shape}")
        if not jnp.issubdtype(initial_state.dtype, jnp.floating):
            raise ValueError(f"initial_state must be floating point; received {initial_state.dtype}")
        return shape[0]
    if global_seq_idx is None:
        return q.shape[0]
    if not isinstance(num_sequences, int) or isinstance(num_sequences, bool) or num_sequences < 1:
        raise ValueError("output_final_state without initial_state needs num_sequences (static N, the runs of "
                         f"global_seq_idx); received {num_sequences!r}")
    return num_sequences


def _resolve_exchange(summary_exchange, cp_size: int) -> str:
    exchange = resolve_summary_exchange(summary_exchange, cp_size) if isinstance(summary_exchange, str) else None
    if exchange is None:
        raise ValueError(f"summary_exchange must be one of {SUMMARY_EXCHANGES}; received {summary_exchange!r}")
    return exchange


def _check_max_sequences(max_sequences, local_len: int) -> int:
    if not isinstance(max_sequences, int) or isinstance(max_sequences, bool) or max_sequences < 1:
        raise ValueError(f"max_sequences must be a positive int; received {max_sequences!r}")
    return min(max_sequences, local_len)


def gdp_chunkwise_context_parallel(q, k, v, g, beta, *, mesh, axis_name: str = "cp", global_seq_idx=None,
                                   max_sequences: int | None = None, scale: float | None = None,
                                   num_householder: int = 1, use_qk_l2norm_in_kernel: bool = False,
                                   backend: Any = None, check_inputs: bool = True, initial_state=None,
                                   output_final_state: bool = False, summary_exchange: str = "all_gather",
                                   layout: str = "contiguous"):
    """Chunkwise-CP Gated DeltaProduct on *global* arrays split along T over ``mesh[axis_name]``.

    q [B, T, H, K], k [B, T*n_h, H, K], v [B, T*n_h, H, V], g [B, T, H], beta [B, T*n_h, H]
    (sharded along T, or placed so here); T divisible by the axis size. ``global_seq_idx``: int
    [1, T] nondecreasing sequence ids (B = 1), replicated; None = each batch row one sequence.
    ``max_sequences``: at most this many sequences touch one shard (None: read from concrete ids,
    else L; see the module docstring). g may be None (no gate).
    Returns o [B, T, H, V] in q's dtype, sharded along T like the inputs. Works eagerly and under
    ``jax.jit`` / ``jax.grad``, on meshes with Auto or Explicit axes; the packing is data, so a
    new ``global_seq_idx`` does not recompile. Other mesh axes see replicated inputs; to shard
    those too, call ``gdp_chunkwise_context_parallel_shard`` inside your own ``jax.shard_map``.

    check_inputs: with concrete (not traced) inputs, NaN/Inf, g > 0 and beta outside [0, 2] raise
    ValueError (one host read). Under ``jax.jit`` only the static checks run (shapes, K ≤ 256,
    V ≤ 512, T ≥ 1, concrete ids); non-finite values are then contained, as always
    (docs/failure_modes.md).

    Sequence states, as the one-device ``jax_api.gated_delta_product``: ``initial_state`` float
    [N, H, K, V] (row n: the n-th run of equal ids, or batch row n without ids; replicated) enters each
    sequence where it starts; ``output_final_state=True`` returns ``(o, final_state float32 [N, H, K, V])``,
    replicated (the sum over ranks of each rank's rows, ``gdp_chunkwise_context_parallel_shard``);
    gradients reach ``initial_state``. N is read from concrete ids (traced ids need an initial_state).

    ``summary_exchange``: "all_gather" | "scan" | "auto", as ``gdp_chunkwise_context_parallel_shard``.

    ``layout="zigzag"`` (``cp_linear.zigzag``): the arrays' T axis holds the shards in rank order, rank r's
    being chunks r and 2·cp−1−r of 2·cp (``x[:, layout_permutation(T, cp, "zigzag")]`` of a sequence-ordered
    x; T divisible by 2·cp), and o comes back in the same order; ``global_seq_idx`` stays in sequence order.
    No sequence states nor scan exchange there (ValueError).
    """
    if axis_name not in getattr(mesh, "axis_names", ()):
        raise ValueError(f"mesh has no axis {axis_name!r}; its axes are {tuple(getattr(mesh, 'axis_names', ()))}")
    cp_size = mesh.shape[axis_name]
    exchange = _resolve_exchange(summary_exchange, cp_size)
    g = gate_or_zeros(g, q)
    check_gdp_inputs(q, k, v, g, beta, num_householder)
    backend, scale = _resolve(q, k, v, num_householder, backend, scale)
    batch, tokens = q.shape[:2]
    if tokens % cp_size:
        raise ValueError(f"T = {tokens} must be divisible by the size of mesh axis {axis_name!r} ({cp_size})")
    shard_len = chunk_length(tokens, cp_size, check_layout(layout))  # a zig-zag chunk: one of 2·cp
    if layout == "zigzag":  # before the states' own checks, as torch
        from jax_api.gdp.zigzag import check_zigzag_options

        check_zigzag_options(exchange, initial_state is not None or bool(output_final_state))
    arrays = (q, k, v, g, beta)
    if check_inputs and is_concrete(*arrays):
        raise_failed_value_checks(GDP_VALUE_CHECKS, gdp_value_flags, *arrays, what="gdp_chunkwise_context_parallel")
    bound = None
    sequences = batch if initial_state is None else None
    if global_seq_idx is not None:
        _check_seq_idx_shape(global_seq_idx, batch, tokens)
        host_ids = host_value_or_none(global_seq_idx)
        sequences = None
        if host_ids is not None:  # concrete ids are checked on the host; traced ones cannot be
            shards = tokens // shard_len
            ids = validate_global_seq_idx(host_ids, shards)
            bound = max_shard_sequences(ids, shards)
            sequences = 1 + int(np.count_nonzero(np.diff(ids)))
        if max_sequences is not None:
            bound = _check_max_sequences(max_sequences, shard_len)
        arrays += (global_seq_idx,)
    if initial_state is not None or output_final_state:
        sequences = _state_rows(initial_state, sequences, global_seq_idx, q, v)
        if initial_state is not None:
            if check_inputs and is_concrete(initial_state) and not bool(jnp.all(jnp.isfinite(initial_state))):
                raise ValueError("gdp_chunkwise_context_parallel: NaN/Inf in initial_state")
            arrays += (initial_state,)
    program = _global_program(run_mesh(mesh), axis_name, global_seq_idx is not None, bound, scale, num_householder,
                              bool(use_qk_l2norm_in_kernel), backend, initial_state is not None,
                              bool(output_final_state), sequences, exchange, layout)
    return program(*arrays)


@functools.lru_cache(maxsize=64)
def _global_program(mesh, axis_name: str, packed: bool, max_sequences: int | None, scale: float,
                    num_householder: int, use_qk_l2norm_in_kernel: bool, backend, has_initial: bool = False,
                    output_final_state: bool = False, num_sequences: int | None = None,
                    summary_exchange: str = "all_gather", layout: str = "contiguous"):
    """jit(place inputs, then shard_map the per-shard function), built once per configuration so
    that eager calls reuse their compiled program too."""
    options = dict(axis_name=axis_name, scale=scale, num_householder=num_householder,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, backend=backend, max_sequences=max_sequences,
                   output_final_state=output_final_state, num_sequences=num_sequences,
                   summary_exchange=summary_exchange, layout=layout)

    def per_shard(q, k, v, g, beta, *extra):
        seq_idx = extra[0] if packed else None
        initial = extra[-1] if has_initial else None
        result = gdp_chunkwise_context_parallel_shard(q, k, v, g, beta, global_seq_idx=seq_idx,
                                                      initial_state=initial, **options)
        if not output_final_state:
            return result
        output, final = result
        return output, jax.lax.psum(final, axis_name)  # each rank holds the rows ending on it

    in_specs = (P(None, axis_name),) * 5 + ((P(),) if packed else ()) + ((P(),) if has_initial else ())
    out_specs = (P(None, axis_name), P()) if output_final_state else P(None, axis_name)
    run = jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

    def program(*arrays):
        placed = [place(x, mesh, P(None, axis_name)) for x in arrays[:5]]
        placed += [place(x, mesh, P()) for x in arrays[5:]]
        return run(*placed)

    return jax.jit(program)
