"""Block-diagonal causal softmax attention under context parallelism, on a JAX mesh.

``blockdiag_attention`` takes *global* q/k/v sharded along T over ``mesh[axis_name]`` and runs
``blockdiag_attention_shard`` inside ``jax.shard_map``; the shard function exchanges K/V with the
plan's collective (exchange.py) and runs an exact masked softmax on the received rows.

Plans are host ints built from concrete, replicated ``doc_ids`` at trace time, so every host
computes the same plan and raises the same ValueError before any collective runs. To keep one
compiled program across packings, build the plan outside ``jax.jit`` with
``plan_blockdiag_exchange`` and pass it (a pytree) in place of ``doc_ids``: only a change of its
shape class (resolved mode, rounded exchange sizes, T, cp size) recompiles.

Zig-zag layout (``layout="zigzag"``, ``cp_linear.zigzag``): rank r holds chunks r and 2·cp−1−r; K/V
are all-gathered (exchange.py) and each local chunk is one query piece at its global positions, as in
torch. The halo and a2a modes are contiguous-only (ValueError with torch's message).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from cp_linear.plan import MODE_CHOICES
from cp_linear.validation import NONFINITE, any_in_ranges, attention_dims_error, nonfinite_rows, poison, sanitize
from jax_api._checks import is_concrete, raise_failed_value_checks
from cp_linear.zigzag import check_layout
from jax_api._chunks import local_chunks
from jax_api._mesh import place, run_mesh
from jax_api.attention.exchange import (
    BlockDiagExchangePlan,
    check_exchange_plan,
    exchange_kv,
    plan_blockdiag_exchange,
    received_tokens_per_rank,
)

__all__ = [
    "BlockDiagExchangePlan",
    "blockdiag_attention",
    "blockdiag_attention_shard",
    "plan_blockdiag_exchange",
    "received_tokens_per_rank",
]

_MASKED_LOGIT = -1e30  # finite, so fully masked (padding) rows never produce inf - inf


def _check_qkv(q, k, v, *, where: str) -> None:
    """Shapes q [B, T, Hq, D], k/v [B, T, Hkv, D] with Hq % Hkv == 0; one floating dtype."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be 4-D [B, T, H, D] ({where}); received shape {getattr(x, 'shape', x)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape ({where}); received {k.shape} and {v.shape}")
    batch, tokens, q_heads, head_dim = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (batch, tokens, head_dim):
        raise ValueError(
            f"k/v must be [B, T, Hkv, D] = [{batch}, {tokens}, Hkv, {head_dim}] to match q ({where}); "
            f"received {k.shape}"
        )
    empty = attention_dims_error(q.shape, k.shape)
    if empty:
        raise ValueError(f"{empty} ({where})")
    if q_heads % k.shape[2]:
        raise ValueError(f"q heads ({q_heads}) must be a multiple of k/v heads ({k.shape[2]})")
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or not jnp.issubdtype(next(iter(dtypes)), jnp.floating):
        raise ValueError(
            f"q, k, v must share one floating dtype; received {jnp.dtype(q.dtype)}, {jnp.dtype(k.dtype)}, "
            f"{jnp.dtype(v.dtype)}"
        )


def _check_plan_mode(plan: BlockDiagExchangePlan, mode: str) -> None:
    """``mode`` must be "auto" (use the plan's) or the mode the plan was built for."""
    if mode not in MODE_CHOICES:
        raise ValueError(f"mode must be one of {MODE_CHOICES}; received {mode!r}")
    if mode != "auto" and mode != plan.mode:
        raise ValueError(
            f"mode={mode!r} was requested but the plan was built for mode={plan.mode!r}; build it with "
            f"plan_blockdiag_exchange(doc_ids, cp_size, mode={mode!r}) (which checks that the mode is possible)"
        )


QUERY_BLOCK = 512  # queries per block: scores live as [B, H, 512, keys] at a time, forward and backward


def _attend(q, keys, values, key_positions, doc_ids, query_positions, query_valid, *, scale: float):
    """Masked softmax of one block of queries at global ``query_positions`` (``query_valid`` False:
    a padding slot past the shard) over the key window; float32 [B, Lq, Hq, D]."""
    batch, length, q_heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    last = doc_ids.shape[0] - 1
    query_docs = jnp.where(query_valid, doc_ids[jnp.clip(query_positions, 0, last)], 0)
    key_docs = jnp.where(key_positions >= 0, doc_ids[jnp.clip(key_positions, 0, last)], -1)
    allowed = (
        (query_docs[:, None] == key_docs[None, :])
        & (key_positions[None, :] <= query_positions[:, None])
        & (query_docs[:, None] > 0)
    )  # [Lq, N]
    grouped = q.astype(jnp.float32).reshape(batch, length, kv_heads, q_heads // kv_heads, head_dim)
    highest = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("blhgd,nbhd->bhgln", grouped, keys.astype(jnp.float32), precision=highest) * scale
    logits = jnp.where(allowed, logits, _MASKED_LOGIT)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))  # softmax is shift-invariant
    weights = jnp.where(allowed, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgln,nbhd->blhgd", weights, values.astype(jnp.float32), precision=highest)
    return out.reshape(batch, length, q_heads, head_dim)


def masked_attention(q, keys, values, key_positions, doc_ids, *, query_start, scale: float,
                     query_block: int = QUERY_BLOCK):
    """Exact doc-masked causal softmax of local queries over a key window, in float32.

    q [B, L, Hq, D]; keys/values [N, B, Hkv, D]; key_positions int32 [N] (-1: empty row);
    doc_ids int32 [T]; the queries sit at global positions ``query_start + [0, L)``.
    Returns float32 [B, L, Hq, D]; padding queries and queries with no key give exact zeros.
    Queries run in blocks of ``query_block`` under ``jax.checkpoint``, so memory holds one block's
    scores (the full [L, N] score matrix of 8k tokens ran a 2-rank CPU training step out of 24 GiB).

    Non-finite inputs are contained (``cp_linear.validation``): a masked-out key still enters the
    matmuls (0 * NaN = NaN), so the softmax runs on sanitised q/k/v and a real query gets NaN, by
    selection, exactly when its own q or a key/value it may read (its document, up to itself) is
    non-finite; other documents, earlier tokens and padding stay exact.
    """
    def attend(clean_q, clean_keys, clean_values):
        return _masked_attention(clean_q, clean_keys, clean_values, key_positions, doc_ids, query_start=query_start,
                                 scale=scale, query_block=query_block)

    return contain_nonfinite(attend, q, keys, values, key_positions, doc_ids, query_start=query_start)


def contain_nonfinite(attend, q, keys, values, key_positions, doc_ids, *, query_start):
    """``attend(q, keys, values)`` on sanitised inputs, then NaN by selection where a real query may read
    a non-finite value (its own q, or a key/value of its document up to itself); shapes as
    ``masked_attention``. Whatever ``attend`` does with masked keys, no NaN crosses a document."""
    query_bad = nonfinite_rows(q, 1)  # [B, L, Hq]
    key_bad = jnp.moveaxis(nonfinite_rows(keys, 1) | nonfinite_rows(values, 1), 0, 1)  # [B, N, Hkv]
    reads_bad = _reads_nonfinite(key_bad, key_positions, doc_ids, query_start, q.shape[1])  # [B, L, Hkv]
    group = q.shape[2] // keys.shape[2]
    bad = query_bad | jnp.repeat(reads_bad, group, axis=2)
    out = attend(sanitize(q), sanitize(keys), sanitize(values))
    positions = query_start + jnp.arange(q.shape[1], dtype=jnp.int32)
    real = doc_ids[positions] > 0
    return poison(out, (bad & real[None, :, None])[..., None])


def _reads_nonfinite(key_bad, key_positions, doc_ids, query_start, length):
    """bool [B, L, Hkv]: query i may read (same document, key position <= its own) a non-finite row.

    The key window is sorted by position where filled (rows of -1 hold no token), so the keys a
    query may read form one contiguous range of rows: found with two searches, counted with a
    prefix sum (``any_in_ranges``), without an [L, N] mask."""
    positions = query_start + jnp.arange(length, dtype=jnp.int32)
    docs = doc_ids[positions]
    new_run = jnp.concatenate([jnp.ones((1,), bool), doc_ids[1:] != doc_ids[:-1]])
    run_start = jax.lax.cummax(jnp.where(new_run, jnp.arange(doc_ids.shape[0], dtype=jnp.int32), 0))
    filled = jnp.where(key_positions >= 0, key_positions, jnp.iinfo(jnp.int32).min)
    order = jnp.argsort(filled)  # empty rows first, then ascending positions
    sorted_positions = filled[order]
    # unrolled: the default method is a while loop (a launch per halving on a GPU, and no fusion)
    start = jnp.searchsorted(sorted_positions, run_start[positions], side="left", method="scan_unrolled")
    stop = jnp.searchsorted(sorted_positions, positions, side="right", method="scan_unrolled")
    stop = jnp.where(docs > 0, stop, start)
    return any_in_ranges(jnp.take(key_bad, order, axis=1), start, stop)


def _masked_attention(q, keys, values, key_positions, doc_ids, *, query_start, scale: float, query_block: int):
    batch, length, q_heads, head_dim = q.shape
    blocks = -(-length // query_block)
    slots = blocks * query_block
    positions = query_start + jnp.arange(slots, dtype=jnp.int32)
    valid = jnp.arange(slots) < length
    if blocks == 1:
        return _attend(q, keys, values, key_positions, doc_ids, positions[:length], valid[:length], scale=scale)
    padded = jnp.pad(q, ((0, 0), (0, slots - length), (0, 0), (0, 0)))
    q_blocks = jnp.moveaxis(padded.reshape(batch, blocks, query_block, q_heads, head_dim), 1, 0)

    @jax.checkpoint
    def one_block(args):
        block_q, block_positions, block_valid = args
        return _attend(block_q, keys, values, key_positions, doc_ids, block_positions, block_valid, scale=scale)

    out = jax.lax.map(one_block, (q_blocks, positions.reshape(blocks, query_block), valid.reshape(blocks, query_block)))
    return jnp.moveaxis(out, 0, 1).reshape(batch, slots, q_heads, head_dim)[:, :length]


def _check_plan_layout(plan: BlockDiagExchangePlan, layout: str) -> None:
    check_layout(layout)
    if layout != plan.layout:
        raise ValueError(f"layout={layout!r} differs from the plan's layout={plan.layout!r}; build the plan with "
                         f"plan_blockdiag_exchange(doc_ids, cp_size, layout={layout!r})")


def blockdiag_attention_shard(q, k, v, *, plan: BlockDiagExchangePlan, axis_name: str = "cp", mode: str = "auto",
                              scale: float | None = None, layout: str = "contiguous", max_runs: int | None = None):
    """Per-shard block-diagonal attention; call it *inside* your own ``jax.shard_map``.

    q [B, L, Hq, D], k/v [B, L, Hkv, D]: this rank's shard (tokens ``[r*L, (r+1)*L)``);
    ``plan`` from ``plan_blockdiag_exchange(doc_ids, cp_size, mode=...)``, passed into the
    shard_map replicated (``PartitionSpec()``); ``axis_name`` the mesh axis the sequence is split
    over; ``mode`` "auto" (the plan's) or the plan's own mode. Returns [B, L, Hq, D] in q's dtype:
    each query attends causally within its own document; padding rows are exactly 0.
    ``layout``: the plan's ("contiguous", or "zigzag": the shard holds chunks r and 2·cp−1−r of 2·cp,
    ``cp_linear.zigzag``; each chunk's queries attend at their global positions).
    All checks run at trace time, identically on every rank, before any collective.
    ``max_runs``: a static bound on the runs of doc ids in one local piece (``TokenLayout.max_attention_runs``);
    with it the pieces may run on cuDNN (``jax_api.attention.cudnn.cudnn_cp_reason``), else in jnp.
    """
    if not isinstance(plan, BlockDiagExchangePlan):
        raise ValueError(f"plan must be a BlockDiagExchangePlan; received {type(plan).__name__}")
    try:
        cp_size = jax.lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"axis name {axis_name!r} is not bound here: call blockdiag_attention_shard inside a jax.shard_map "
            f"over a mesh with that axis (or use blockdiag_attention with a mesh)"
        ) from err
    _check_qkv(q, k, v, where="local shards")
    if cp_size != plan.cp_size or q.shape[1] != plan.local_len:
        raise ValueError(
            f"the plan is for cp_size = {plan.cp_size}, L = {plan.local_len}; received axis {axis_name!r} of size "
            f"{cp_size} and local shards of length {q.shape[1]}"
        )
    _check_plan_mode(plan, mode)
    _check_plan_layout(plan, layout)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kv = jnp.moveaxis(jnp.stack([k, v], axis=0), 2, 0)  # [L, 2, B, Hkv, D]: K and V travel together
    rows, key_positions = exchange_kv(kv, plan, axis_name=axis_name)
    doc_ids = jnp.asarray(plan.doc_ids, jnp.int32)
    chunks = local_chunks(axis_name, plan.layout)  # one query piece per chunk, at its global positions
    chunk_len = plan.local_len // chunks.shape[0]
    from jax_api.attention.cudnn import cudnn_cp_reason, cudnn_window_attention

    attend = masked_attention
    if cudnn_cp_reason(q, k, max_runs) is None:
        attend = functools.partial(cudnn_window_attention, max_runs=max_runs)
    out = jnp.concatenate([
        attend(q[:, slot * chunk_len:(slot + 1) * chunk_len], rows[:, 0], rows[:, 1], key_positions,
               doc_ids, query_start=chunk * chunk_len, scale=scale)
        for slot, chunk in enumerate(chunks)], axis=1)
    return out.astype(q.dtype)


def _mesh_axis_size(mesh, axis_name: str) -> int:
    names = tuple(getattr(mesh, "axis_names", ()))
    if axis_name not in names:
        raise ValueError(f"axis name {axis_name!r} is not an axis of the mesh; mesh axes are {names}")
    return int(mesh.shape[axis_name])


def _mesh_platform(mesh) -> str:
    return mesh.devices.flat[0].platform


def _qkv_flags(q, k, v):
    return [~jnp.all(jnp.isfinite(x)) for x in (q, k, v)]


_QKV_CHECKS = tuple((name, f"{NONFINITE} in {name}") for name in ("q", "k", "v"))


def blockdiag_attention(q, k, v, doc_ids, *, mesh, axis_name: str = "cp", mode: str = "auto",
                        scale: float | None = None, check_inputs: bool = True, layout: str = "contiguous"):
    """Block-diagonal causal softmax attention of global arrays sharded along T over ``mesh[axis_name]``.

    q [B, T, Hq, D], k/v [B, T, Hkv, D] (GQA: Hq a multiple of Hkv), T divisible by the axis size;
    ``doc_ids`` int [T] replicated and concrete (0 = padding, anywhere; each document one
    contiguous run) or a ``BlockDiagExchangePlan`` built from them (the way to call this under
    ``jax.jit`` without recompiling per packing). ``mode``: "auto" (halo when every straddle fits in
    the left neighbour, else a2a), "allgather", "halo" (ValueError when impossible) or "a2a".
    ``scale`` defaults to D**-0.5. Returns [B, T, Hq, D] in q's dtype, sharded like the inputs
    (``P(None, axis_name)``); padding rows are exactly 0. Differentiable (``jax.grad``).

    check_inputs: with concrete (not traced) q/k/v, NaN/Inf raises ValueError (one host read).
    Under ``jax.jit`` values cannot be read; non-finite inputs are then contained, as always: a
    query that may read one outputs NaN, every other output is exact. A plan passed in place of
    ``doc_ids`` is checked against its own ids when they are concrete (an edited plan raises).

    layout: "contiguous" or "zigzag" (``cp_linear.zigzag``, all-gather only; halo / a2a raise): the
    arrays' T axis then holds the shards in rank order, rank r's being chunks r and 2·cp−1−r
    (``x[:, layout_permutation(T, cp, "zigzag")]`` of a sequence-ordered x), and so does the output;
    ``doc_ids`` stay in sequence order. A plan passed in place of ``doc_ids`` must be of this layout.
    """
    cp_size = _mesh_axis_size(mesh, axis_name)
    _check_qkv(q, k, v, where="global arrays")
    tokens = q.shape[1]
    if tokens % cp_size:
        raise ValueError(f"T = {tokens} must be divisible by the size {cp_size} of mesh axis {axis_name!r}")
    if check_inputs and is_concrete(q, k, v):
        raise_failed_value_checks(_QKV_CHECKS, _qkv_flags, q, k, v, what="blockdiag_attention")
    if isinstance(doc_ids, BlockDiagExchangePlan):
        plan = doc_ids
        check_exchange_plan(plan)
    else:
        if getattr(doc_ids, "shape", None) is not None and tuple(doc_ids.shape)[-1:] != (tokens,):
            raise ValueError(f"doc_ids must have shape [T] = [{tokens}]; received shape {tuple(doc_ids.shape)}")
        plan = plan_blockdiag_exchange(doc_ids, cp_size, mode=mode, platform=_mesh_platform(mesh), layout=layout)
    if plan.cp_size != cp_size or plan.total_len != tokens:
        raise ValueError(
            f"the plan is for cp_size = {plan.cp_size}, T = {plan.total_len}; received mesh axis {axis_name!r} "
            f"of size {cp_size} and T = {tokens}"
        )
    _check_plan_mode(plan, mode)
    _check_plan_layout(plan, layout)
    scale = None if scale is None else float(scale)  # a static (hashable) jit argument
    return _sharded_attention(q, k, v, plan, mesh=run_mesh(mesh), axis_name=axis_name, mode=mode, scale=scale)


@functools.partial(jax.jit, static_argnames=("mesh", "axis_name", "mode", "scale"))
def _sharded_attention(q, k, v, plan, *, mesh, axis_name, mode, scale):
    # Jitted once per (mesh, shapes, plan shape class): eager calls reuse the compiled program too.
    spec = P(None, axis_name)
    q, k, v = (place(x, mesh, spec) for x in (q, k, v))  # Explicit axes: the types must match shard_map's

    def per_shard(q_shard, k_shard, v_shard, shard_plan):
        return blockdiag_attention_shard(q_shard, k_shard, v_shard, plan=shard_plan, axis_name=axis_name,
                                         mode=mode, scale=scale, layout=shard_plan.layout)

    sharded = jax.shard_map(per_shard, mesh=mesh, in_specs=(spec, spec, spec, P()), out_specs=spec)
    return sharded(q, k, v, plan)
