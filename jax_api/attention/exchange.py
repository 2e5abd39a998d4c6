"""K/V exchanges for block-diagonal attention under CP, run inside ``jax.shard_map``.

Glossary (docs/design.md §3)
  L              local length; rank ``r`` owns tokens ``[r*L, (r+1)*L)`` of the global sequence
  needed range   ``[s_first[r], real_end[r])``: the keys/values rank r attends to
  back[r]        ``r*L - s_first[r]``: needed tokens that live on earlier ranks
  key window     what an exchange returns: received K/V rows plus the global position of each
                 row (-1 where a row holds no token); the attention mask is built from these
                 positions and the replicated ``doc_ids``, so an exchange may deliver *more*
                 tokens than needed (extra rows belong to other documents and are masked out).

Every rank only ever needs tokens of *earlier* ranks (documents run left to right), and the
piece a source sends to a later rank is always a *suffix* of the source's shard. So::

    doc ids   1 1 1 1 | 1 1 2 2 | 2 2 2 2 | 2 3 3 0      T = 16, cp = 4, L = 4
    back      0       | 4       | 2       | 3
    halo      rank r receives the last max(back) tokens of rank r - 1 (one ppermute)
    a2a       rank 3 needs rank 2's last 3 tokens and nothing from ranks 0, 1

Exchanges (all differentiable through JAX's own transpose rules):
  all-gather   ``lax.all_gather`` of the whole shard (backward: psum_scatter)
  halo         ``lax.ppermute`` of the last ``halo_len`` tokens to the right neighbour
               (backward: the reverse ppermute)
  a2a/ppermute one ``ppermute`` per rank distance ``s`` that carries the last ``piece_len[s]``
               tokens; the portable needed-only exchange (XLA:CPU has no ragged all-to-all)
  a2a/ragged   ``lax.ragged_all_to_all`` of exactly the needed pieces (GPU/TPU); pieces are
               first gathered into a send buffer so that a token needed by several ranks is sent
               from separate rows (the transpose then scatter-adds their gradients instead of
               letting one overwrite the other)

Zig-zag layout (``layout="zigzag"``, ``cp_linear.zigzag``): rank r holds chunks r and 2·cp−1−r. The plan
validates the ids as the contiguous plan of the 2·cp chunks (as torch does) and always all-gathers; the
gathered rows stay in rank order, each labelled with its global position (``layout_permutation``), so
the doc mask needs no reordering. The halo and a2a modes are contiguous-only (ValueError, torch's message).

Shapes are static per *shape class* (``BlockDiagExchangePlan``'s meta fields, a
``cp_linear.plan.ExchangeShape``): the exchange sizes are rounded up to powers of two, so a new
packing recompiles only when a rounded size, the resolved mode, ``T`` or ``cp_size`` changes.
Positions and routing tables are ordinary (traced) arrays of the plan. The policy (modes, their
resolution, the sizes, the ragged tables, the bytes moved) is the core's (``cp_linear.plan``);
this module only runs it as JAX collectives.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cp_linear.plan import (
    ExchangeShape,
    build_blockdiag_plan,
    exchange_shape,
    exchange_shape_error,
    exchange_tokens_received,
    ids_fingerprint,
    ragged_routing,
    validate_doc_ids,
)
from cp_linear.zigzag import check_layout, layout_permutation, virtual_shard_count, zigzag_attention_mode_error

A2A_IMPLEMENTATIONS = ("auto", "ragged", "ppermute")
# Platforms whose XLA backend implements the ragged-all-to-all HLO.
RAGGED_A2A_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class BlockDiagExchangePlan:
    """A block-diagonal attention plan as a JAX pytree: static shape class + traced arrays.

    Meta (static, hashed by ``jax.jit``; a change recompiles):
      cp_size, local_len   world size and L
      layout               "contiguous" or "zigzag" (``cp_linear.zigzag``; all-gather only)
      shape                the core's ``cp_linear.plan.ExchangeShape``: the resolved mode, the a2a
                           implementation ("ragged" | "ppermute") and the static sizes (halo rows,
                           rows per rank distance, ragged buffer rows); read through the properties
                           ``mode``, ``a2a_impl``, ``halo_len``, ``piece_lens``, ``recv_len``, ``send_len``
    Data (traced leaves, replicated on every rank):
      doc_ids              int32 [T]
      routing              ragged tables, each indexed by rank (empty for other modes):
                           send_index int32 [cp, send_len] local rows in send-buffer order;
                           input_offsets, send_sizes, output_offsets, recv_sizes int32 [cp, cp]
    """

    doc_ids: object
    routing: tuple
    cp_size: int
    local_len: int
    shape: ExchangeShape
    layout: str = "contiguous"

    @property
    def total_len(self) -> int:
        return self.cp_size * self.local_len

    mode = property(lambda self: self.shape.mode)
    a2a_impl = property(lambda self: self.shape.a2a_impl)
    halo_len = property(lambda self: self.shape.halo_len)
    piece_lens = property(lambda self: self.shape.piece_lens)
    recv_len = property(lambda self: self.shape.recv_len)
    send_len = property(lambda self: self.shape.send_len)


jax.tree_util.register_dataclass(BlockDiagExchangePlan, data_fields=["doc_ids", "routing"],
                                 meta_fields=["cp_size", "local_len", "shape", "layout"])


def default_a2a_impl(platform: str) -> str:
    return "ragged" if platform.lower() in RAGGED_A2A_PLATFORMS else "ppermute"


def plan_blockdiag_exchange(doc_ids, cp_size: int, *, mode: str = "auto", platform: str | None = None,
                            a2a_impl: str = "auto", bucket_sizes: bool = True,
                            shape: ExchangeShape | None = None, layout: str = "contiguous") -> BlockDiagExchangePlan:
    """Build the exchange plan from concrete replicated ``doc_ids`` int [T] (0 = padding).

    Identical on every host (host ints, no communication). ``platform`` ("cpu", "gpu", ...;
    default ``jax.default_backend()``) picks the a2a implementation when ``a2a_impl="auto"``:
    ragged all-to-all where XLA implements it, per-distance ppermutes elsewhere.
    ``bucket_sizes`` rounds static exchange sizes up to powers of two (fewer recompilations,
    at most twice the exact bytes); False keeps them exact.
    ``shape`` fixes the static sizes instead (a ``cp_linear.plan.ExchangeShape`` of a resolved mode,
    e.g. ``cp_linear.plan.widest_exchange_shape("a2a", cp_size, L, a2a_impl="ppermute")``): every
    plan built with it has one shape class, so a jitted caller never retraces for a new packing;
    ValueError when this packing needs more than it holds.
    Raises ValueError for bad ids (reappearing documents, T not divisible by cp_size, ...) and
    for ``mode="halo"`` when a document spans more than two ranks.
    ``layout``: "contiguous" or "zigzag" (``cp_linear.zigzag``: T divisible by 2·cp, ``mode`` "auto" or
    "allgather", no fixed ``shape`` of another mode); the ids stay in global order.
    """
    if a2a_impl not in A2A_IMPLEMENTATIONS:
        raise ValueError(f"a2a_impl must be one of {A2A_IMPLEMENTATIONS}; received {a2a_impl!r}")
    if check_layout(layout) == "zigzag":
        mode_error = zigzag_attention_mode_error(mode)
        if mode_error or (shape is not None and shape != ExchangeShape("allgather")):
            raise ValueError(mode_error or f"layout='zigzag' exchanges K/V by all-gather; received the fixed "
                                           f"shape {shape}")
    if isinstance(doc_ids, jax.Array):
        try:
            doc_ids = np.asarray(doc_ids)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError) as err:
            raise ValueError(
                "doc_ids must be concrete to build a block-diagonal plan; received a traced value. Build the plan "
                "outside jax.jit with jax_api.attention.blockdiag.plan_blockdiag_exchange(doc_ids, cp_size) and "
                "pass the plan (a pytree) through jit in place of doc_ids"
            ) from err
    shards = virtual_shard_count(cp_size, layout)  # zig-zag: the plan of the 2·cp chunks checks the ids
    ids = validate_doc_ids(doc_ids, shards)  # int64 [T] on the host; ValueError for bad ids
    host_plan = build_blockdiag_plan(ids, shards)
    if ids.max() > np.iinfo(np.int32).max:
        raise ValueError(f"doc_ids must fit in int32; received a maximum of {int(ids.max())}")
    impl = a2a_impl
    if impl == "auto":
        impl = default_a2a_impl(platform or jax.default_backend())
    if layout == "zigzag":
        shape = ExchangeShape("allgather")
    elif shape is None:
        shape = exchange_shape(host_plan, mode, a2a_impl=impl, bucket=bucket_sizes)  # ValueError: impossible halo
    else:
        _check_fixed_shape(host_plan, shape, mode, a2a_impl)
    routing = ragged_routing(host_plan, shape) if shape.a2a_impl == "ragged" else ()
    return BlockDiagExchangePlan(doc_ids=ids.astype(np.int32), routing=routing, cp_size=int(cp_size),
                                 local_len=ids.shape[0] // cp_size, shape=shape, layout=layout)


def _check_fixed_shape(host_plan, shape: ExchangeShape, mode: str, a2a_impl: str) -> None:
    """``shape`` (the caller's fixed sizes) must be of the requested mode and cover this packing."""
    if not isinstance(shape, ExchangeShape):
        raise ValueError(f"shape must be a cp_linear.plan.ExchangeShape; received {type(shape).__name__}")
    if mode not in ("auto", shape.mode):
        raise ValueError(f"mode={mode!r} was requested with a fixed shape of mode {shape.mode!r}")
    runs_as = ("ragged", "ppermute")
    if shape.mode == "a2a" and (shape.a2a_impl not in runs_as or a2a_impl not in ("auto", shape.a2a_impl)):
        raise ValueError(f"a fixed a2a shape runs as 'ragged' or 'ppermute' (a2a_impl={a2a_impl!r}); "
                         f"received a2a_impl {shape.a2a_impl!r}")
    problem = exchange_shape_error(host_plan, shape)
    if problem:
        raise ValueError(f"this packing does not fit the fixed exchange shape: {problem}")


def check_exchange_plan(plan: BlockDiagExchangePlan) -> None:
    """Raise ValueError unless ``plan`` still serves its own ``doc_ids`` (tamper-evident plans).

    An edited plan (``dataclasses.replace`` of a halo length, piece sizes, mode or routing tables)
    would drop needed keys silently. This rebuilds the host plan from the ids, checks the static sizes
    with ``cp_linear.plan.exchange_shape_error`` (larger is fine: extra rows are masked by doc ids)
    and the ragged tables against the rebuilt ones. Needs concrete ids (skipped for traced ones,
    e.g. inside the caller's own ``jax.jit``); cached per plan object and ids fingerprint.
    """
    ids = plan.doc_ids
    if isinstance(ids, jax.core.Tracer):
        return
    ids = np.asarray(ids)
    fingerprint = ids_fingerprint(ids)
    if getattr(plan, "_checked", None) == fingerprint:
        return
    problem = _plan_problem(plan, ids)
    if problem:
        raise ValueError(f"the BlockDiagExchangePlan does not fit its doc_ids: {problem}; it was edited after "
                         "plan_blockdiag_exchange built it (build a new plan from the ids)")
    object.__setattr__(plan, "_checked", fingerprint)


def _plan_problem(plan: BlockDiagExchangePlan, ids: np.ndarray) -> str | None:
    if ids.ndim != 1 or ids.shape[0] != plan.total_len:
        return f"doc_ids have shape {ids.shape}; the plan is for T = cp_size * L = {plan.cp_size} * {plan.local_len}"
    try:
        shards = virtual_shard_count(plan.cp_size, plan.layout)
        host_plan = build_blockdiag_plan(validate_doc_ids(ids, shards), shards)
    except ValueError as err:
        return str(err)
    if plan.layout == "zigzag" and plan.shape != ExchangeShape("allgather"):
        return f"a zig-zag plan all-gathers; it holds the exchange {plan.shape}"
    problem = exchange_shape_error(host_plan, plan.shape)
    if problem is None and plan.a2a_impl == "ragged":
        expected = ragged_routing(host_plan, plan.shape)
        tables = [np.asarray(table) for table in plan.routing]
        if len(tables) != len(expected) or any(t.shape != e.shape or not np.array_equal(t, e)
                                              for t, e in zip(tables, expected)):
            problem = "the ragged routing tables differ from the ones the ids give"
    elif problem is None and plan.routing:
        problem = f"mode {plan.mode!r} ({plan.a2a_impl or 'no a2a'}) carries routing tables"
    return problem


def received_tokens_per_rank(plan: BlockDiagExchangePlan) -> list[int]:
    """K/V rows each rank receives from other ranks in one direction, as this plan runs it.

    Static (bucketed) sizes count in full because they travel in full; the ragged exchange moves
    exactly the needed rows (``cp_linear.plan.exchange_tokens_received``). Multiply by
    ``2 * B * Hkv * D * itemsize`` for bytes (K and V), or use ``cp_linear.exchange_bytes``.
    """
    if plan.layout == "zigzag":  # the all-gather: every other rank's L tokens
        return [(plan.cp_size - 1) * plan.local_len] * plan.cp_size
    host_plan = build_blockdiag_plan(np.asarray(plan.doc_ids), plan.cp_size)
    return exchange_tokens_received(host_plan, plan.shape)


# --------------------------------------------------------------------------- exchanges (inside shard_map)
# Each takes kv [L, ...] (tokens leading, K and V stacked behind) and returns (rows [N, ...],
# positions int32 [N]) with position -1 for rows that hold no token.


def allgather_kv(kv, *, axis_name: str, layout: str = "contiguous"):
    """Every rank receives every shard: rows [T, ...] in rank order, positions the global index of each
    row (0..T-1 for the contiguous layout, ``layout_permutation`` for zig-zag)."""
    gathered = jax.lax.all_gather(kv, axis_name, axis=0, tiled=True)
    positions = layout_permutation(gathered.shape[0], jax.lax.axis_size(axis_name), layout)
    return gathered, jnp.asarray(positions, jnp.int32)


def _suffix_from_left(kv, rank, *, distance: int, rows: int, axis_name: str, cp_size: int):
    """The last ``rows`` tokens of rank ``rank - distance`` (zeros and positions -1 where none)."""
    length = kv.shape[0]
    perm = [(src, src + distance) for src in range(cp_size - distance)]
    piece = jax.lax.ppermute(kv[length - rows :], axis_name, perm)
    first = (rank - distance + 1) * length - rows
    positions = first + jnp.arange(rows, dtype=jnp.int32)
    return piece, jnp.where(rank >= distance, positions, -1)


def _with_local(pieces, rank, kv):
    length = kv.shape[0]
    local_positions = rank * length + jnp.arange(length, dtype=jnp.int32)
    rows = jnp.concatenate([p for p, _ in pieces] + [kv], axis=0)
    positions = jnp.concatenate([pos for _, pos in pieces] + [local_positions], axis=0)
    return rows, positions


def halo_kv(kv, *, halo_len: int, axis_name: str, cp_size: int):
    """Left halo: the last ``halo_len`` tokens of the left neighbour, then the local shard."""
    rank = jax.lax.axis_index(axis_name)
    pieces = []
    if halo_len and cp_size > 1:
        pieces.append(_suffix_from_left(kv, rank, distance=1, rows=halo_len, axis_name=axis_name, cp_size=cp_size))
    return _with_local(pieces, rank, kv)


def needed_kv_ppermute(kv, *, piece_lens: tuple[int, ...], axis_name: str, cp_size: int):
    """Needed-only exchange without ragged collectives: one ppermute per rank distance that is used."""
    rank = jax.lax.axis_index(axis_name)
    pieces = [
        _suffix_from_left(kv, rank, distance=distance, rows=rows, axis_name=axis_name, cp_size=cp_size)
        for distance, rows in sorted(enumerate(piece_lens, start=1), reverse=True)
        if rows
    ]
    return _with_local(pieces, rank, kv)


def needed_kv_ragged(kv, routing, *, recv_len: int, send_len: int, axis_name: str):
    """Needed-only exchange of exactly the needed pieces with ``lax.ragged_all_to_all``."""
    rank = jax.lax.axis_index(axis_name)
    pieces = []
    if recv_len:
        send_index, input_offsets, send_sizes, output_offsets, recv_sizes = (table[rank] for table in routing)
        send_buffer = jnp.take(kv, send_index[:send_len], axis=0)
        received = jax.lax.ragged_all_to_all(
            send_buffer, jnp.zeros((recv_len, *kv.shape[1:]), kv.dtype),
            input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name,
        )
        positions = rank * kv.shape[0] - recv_len + jnp.arange(recv_len, dtype=jnp.int32)
        # Rows below s_first are never written (zeros); they hold other documents' positions and
        # are masked by doc ids, but mark rows before the sequence start as empty outright.
        pieces.append((received, jnp.where(positions >= 0, positions, -1)))
    return _with_local(pieces, rank, kv)


def exchange_kv(kv, plan: BlockDiagExchangePlan, *, axis_name: str):
    """Run the plan's exchange on kv [L, ...]; return (rows [N, ...], positions int32 [N])."""
    if plan.mode == "allgather":
        return allgather_kv(kv, axis_name=axis_name, layout=plan.layout)
    if plan.mode == "halo":
        return halo_kv(kv, halo_len=plan.halo_len, axis_name=axis_name, cp_size=plan.cp_size)
    if plan.a2a_impl == "ppermute":
        return needed_kv_ppermute(kv, piece_lens=plan.piece_lens, axis_name=axis_name, cp_size=plan.cp_size)
    return needed_kv_ragged(kv, plan.routing, recv_len=plan.recv_len, send_len=plan.send_len, axis_name=axis_name)
