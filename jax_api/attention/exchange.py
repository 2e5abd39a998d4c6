"""K/V exchanges for block-diagonal attention under CP, run inside ``jax.shard_map``.

Glossary (DESIGN.md §3)
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

Shapes are static per *shape class* (``BlockDiagExchangePlan``'s meta fields): the exchange
sizes are rounded up to powers of two, so a new packing recompiles only when a rounded size, the
resolved mode, ``T`` or ``cp_size`` changes. Positions and routing tables are ordinary (traced)
arrays of the plan.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cp_linear.plan import BlockDiagPlan, build_blockdiag_plan, ids_fingerprint, validate_doc_ids

ATTENTION_MODES = ("auto", "allgather", "halo", "a2a")
A2A_IMPLEMENTATIONS = ("auto", "ragged", "ppermute")
# Platforms whose XLA backend implements the ragged-all-to-all HLO.
RAGGED_A2A_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def size_class(tokens: int, cap: int, bucket: bool) -> int:
    """Static buffer length for ``tokens`` rows: the next power of two (capped), or exact."""
    if tokens <= 0:
        return 0
    if not bucket:
        return tokens
    return min(cap, 1 << (tokens - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class BlockDiagExchangePlan:
    """A block-diagonal attention plan as a JAX pytree: static shape class + traced arrays.

    Meta (static, hashed by ``jax.jit``; a change recompiles):
      cp_size, local_len   world size and L
      mode                 the resolved exchange: "allgather" | "halo" | "a2a"
      a2a_impl             "ragged" | "ppermute" for mode "a2a", else ""
      halo_len             static halo rows (mode "halo")
      piece_lens           static rows per rank distance 1..cp-1 (mode "a2a", ppermute)
      recv_len, send_len   static receive / send buffer rows (mode "a2a", ragged)
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
    mode: str
    a2a_impl: str
    halo_len: int = 0
    piece_lens: tuple[int, ...] = ()
    recv_len: int = 0
    send_len: int = 0

    @property
    def total_len(self) -> int:
        return self.cp_size * self.local_len


jax.tree_util.register_dataclass(
    BlockDiagExchangePlan,
    data_fields=["doc_ids", "routing"],
    meta_fields=["cp_size", "local_len", "mode", "a2a_impl", "halo_len", "piece_lens", "recv_len", "send_len"],
)


def resolve_mode(mode: str, host_plan: BlockDiagPlan) -> str:
    """auto -> halo when every straddle fits in the left neighbour, else a2a; validate forced modes."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"mode must be one of {ATTENTION_MODES}; received {mode!r}")
    if mode == "auto":
        return "halo" if host_plan.use_halo else "a2a"
    if mode == "halo" and not host_plan.use_halo:
        raise ValueError(
            f"mode='halo' needs every document straddle to fit in the left neighbour (back ≤ L = "
            f"{host_plan.local_len}); received back = {list(host_plan.back)}: a document spans more than two "
            "ranks. Use mode='a2a' or 'auto'"
        )
    return mode


def default_a2a_impl(platform: str) -> str:
    return "ragged" if platform.lower() in RAGGED_A2A_PLATFORMS else "ppermute"


def plan_blockdiag_exchange(doc_ids, cp_size: int, *, mode: str = "auto", platform: str | None = None,
                            a2a_impl: str = "auto", bucket_sizes: bool = True) -> BlockDiagExchangePlan:
    """Build the exchange plan from concrete replicated ``doc_ids`` int [T] (0 = padding).

    Identical on every host (host ints, no communication). ``platform`` ("cpu", "gpu", ...;
    default ``jax.default_backend()``) picks the a2a implementation when ``a2a_impl="auto"``:
    ragged all-to-all where XLA implements it, per-distance ppermutes elsewhere.
    ``bucket_sizes`` rounds static exchange sizes up to powers of two (fewer recompilations,
    at most twice the exact bytes); False keeps them exact.
    Raises ValueError for bad ids (reappearing documents, T not divisible by cp_size, ...) and
    for ``mode="halo"`` when a document spans more than two ranks.
    """
    if a2a_impl not in A2A_IMPLEMENTATIONS:
        raise ValueError(f"a2a_impl must be one of {A2A_IMPLEMENTATIONS}; received {a2a_impl!r}")
    if isinstance(doc_ids, jax.Array):
        try:
            doc_ids = np.asarray(doc_ids)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError) as err:
            raise ValueError(
                "doc_ids must be concrete to build a block-diagonal plan; received a traced value. Build the plan "
                "outside jax.jit with jax_api.attention.blockdiag.plan_blockdiag_exchange(doc_ids, cp_size) and "
                "pass the plan (a pytree) through jit in place of doc_ids"
            ) from err
    ids = validate_doc_ids(doc_ids, cp_size)  # int64 [T] on the host; ValueError for bad ids
    host_plan = build_blockdiag_plan(ids, cp_size)
    if ids.max() > np.iinfo(np.int32).max:
        raise ValueError(f"doc_ids must fit in int32; received a maximum of {int(ids.max())}")
    ids = ids.astype(np.int32)
    resolved = resolve_mode(mode, host_plan)
    length = host_plan.local_len
    common = dict(doc_ids=ids, cp_size=int(cp_size), local_len=length, mode=resolved)
    if resolved == "allgather":
        return BlockDiagExchangePlan(routing=(), a2a_impl="", **common)
    if resolved == "halo":
        halo = size_class(host_plan.halo_len, length, bucket_sizes)
        return BlockDiagExchangePlan(routing=(), a2a_impl="", halo_len=halo, **common)
    impl = default_a2a_impl(platform or jax.default_backend()) if a2a_impl == "auto" else a2a_impl
    if impl == "ppermute":
        return BlockDiagExchangePlan(routing=(), a2a_impl=impl,
                                     piece_lens=ppermute_piece_lens(host_plan, bucket_sizes), **common)
    routing, recv_len, send_len = ragged_routing(host_plan, bucket_sizes)
    return BlockDiagExchangePlan(routing=routing, a2a_impl=impl, recv_len=recv_len, send_len=send_len, **common)


def ppermute_piece_lens(host_plan: BlockDiagPlan, bucket: bool) -> tuple[int, ...]:
    """Static rows sent over rank distance s = 1..cp-1: the largest suffix any rank needs from s back."""
    cp, length = host_plan.cp_size, host_plan.local_len
    lens = []
    for distance in range(1, cp):
        widest = 0
        for dst in range(distance, cp):
            start, stop = host_plan.recv[dst][dst - distance]
            widest = max(widest, stop - start)
        lens.append(size_class(widest, length, bucket))
    return tuple(lens)


def check_exchange_plan(plan: BlockDiagExchangePlan) -> None:
    """Raise ValueError unless ``plan`` still serves its own ``doc_ids`` (tamper-evident plans).

    An edited plan (``dataclasses.replace`` of a halo length, piece sizes, mode or routing tables)
    would drop needed keys silently; this rebuilds the host plan from the ids and checks that every
    static size covers what each rank needs (larger is fine: extra rows are masked by doc ids) and
    that the ragged tables equal the rebuilt ones. Needs concrete ids (skipped for traced ones, e.g.
    inside the caller's own ``jax.jit``); the result is cached per plan object and ids fingerprint.
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
    cp, length = plan.cp_size, plan.local_len
    if ids.ndim != 1 or ids.shape[0] != cp * length:
        return f"doc_ids have shape {ids.shape}; the plan is for T = cp_size * L = {cp} * {length}"
    try:
        host_plan = build_blockdiag_plan(validate_doc_ids(ids, cp), cp)
    except ValueError as err:
        return str(err)
    if plan.mode not in ("allgather", "halo", "a2a"):
        return f"mode {plan.mode!r} is not a resolved exchange"
    if plan.mode != "a2a" and (plan.a2a_impl or plan.piece_lens or plan.recv_len or plan.send_len or plan.routing):
        return f"mode {plan.mode!r} carries a2a fields"
    if plan.mode == "halo":
        if not host_plan.use_halo or not host_plan.halo_len <= plan.halo_len <= length:
            return (f"halo_len = {plan.halo_len} must lie in [{host_plan.halo_len}, L = {length}] "
                    f"(back = {host_plan.back})")
    if plan.mode == "a2a" and plan.a2a_impl == "ppermute":
        needed = ppermute_piece_lens(host_plan, bucket=False)
        if len(plan.piece_lens) != cp - 1 or any(not n <= p <= length for n, p in zip(needed, plan.piece_lens)):
            return f"piece_lens = {plan.piece_lens} must cover {needed} and stay ≤ L = {length}"
    elif plan.mode == "a2a":
        if plan.a2a_impl != "ragged":
            return f"a2a_impl must be 'ragged' or 'ppermute'; received {plan.a2a_impl!r}"
        _, recv_len, send_len = ragged_routing(host_plan, bucket=False)
        if plan.recv_len < recv_len or plan.send_len < send_len:
            return f"recv_len, send_len = {plan.recv_len}, {plan.send_len} must cover {recv_len}, {send_len}"
        expected, _, _ = ragged_routing(host_plan, bucket=False, recv_len=plan.recv_len, send_len=plan.send_len)
        tables = [np.asarray(t) for t in plan.routing]
        if len(tables) != len(expected) or any(t.shape != e.shape or not np.array_equal(t, e)
                                              for t, e in zip(tables, expected)):
            return "the ragged routing tables differ from the ones the ids give"
    return None


def ragged_routing(host_plan: BlockDiagPlan, bucket: bool, *, recv_len: int | None = None,
                   send_len: int | None = None) -> tuple[tuple[np.ndarray, ...], int, int]:
    """Per-rank tables for ``lax.ragged_all_to_all`` (rank-indexed rows, host int32).

    Receive buffer of rank r: ``recv_len`` rows, right-aligned so that row j holds global token
    ``r*L - recv_len + j``; the piece from ``src`` lands at ``recv_len - (r*L - start)``. Send
    buffer of rank r: its pieces for destinations 0..cp-1 concatenated (``send_index`` = local
    rows), so overlapping pieces for different destinations occupy distinct rows.
    """
    cp, length = host_plan.cp_size, host_plan.local_len
    remote_sizes = [[0] * cp for _ in range(cp)]  # [src][dst]
    for src in range(cp):
        for dst in range(cp):
            if dst != src:
                start, stop = host_plan.send[src][dst]
                remote_sizes[src][dst] = stop - start
    if recv_len is None:
        recv_len = size_class(max(host_plan.back), (cp - 1) * length, bucket)
    if send_len is None:
        send_len = size_class(max(sum(row) for row in remote_sizes), (cp - 1) * length, bucket)
    send_index = np.zeros((cp, max(send_len, 1)), np.int32)
    input_offsets = np.zeros((cp, cp), np.int32)
    send_sizes = np.zeros((cp, cp), np.int32)
    output_offsets = np.zeros((cp, cp), np.int32)
    for src in range(cp):
        cursor = 0
        for dst in range(cp):
            size = remote_sizes[src][dst]
            if size == 0:
                continue
            start, _ = host_plan.send[src][dst]
            send_index[src, cursor : cursor + size] = np.arange(start, start + size) - src * length
            input_offsets[src, dst] = cursor
            send_sizes[src, dst] = size
            output_offsets[src, dst] = recv_len - (dst * length - start)
            cursor += size
    recv_sizes = np.ascontiguousarray(send_sizes.T)  # recv_sizes[dst][src] = send_sizes[src][dst]
    return (send_index, input_offsets, send_sizes, output_offsets, recv_sizes), recv_len, send_len


def received_tokens_per_rank(plan: BlockDiagExchangePlan) -> list[int]:
    """K/V rows each rank receives from other ranks in one direction, as this plan runs it.

    Static (bucketed) sizes count in full because they travel in full; the ragged exchange moves
    exactly the needed rows. Multiply by ``2 * B * Hkv * D * itemsize`` for bytes (K and V).
    """
    cp, length = plan.cp_size, plan.local_len
    if plan.mode == "allgather":
        return [(cp - 1) * length] * cp
    if plan.mode == "halo":
        return [0] + [plan.halo_len] * (cp - 1)
    if plan.a2a_impl == "ppermute":
        return [sum(plan.piece_lens[: rank]) for rank in range(cp)]
    recv_sizes = np.asarray(plan.routing[4])
    return [int(recv_sizes[rank].sum()) for rank in range(cp)]


# --------------------------------------------------------------------------- exchanges (inside shard_map)
# Each takes kv [L, ...] (tokens leading, K and V stacked behind) and returns (rows [N, ...],
# positions int32 [N]) with position -1 for rows that hold no token.


def allgather_kv(kv, *, axis_name: str):
    """Every rank receives every shard: rows [T, ...], positions 0..T-1."""
    gathered = jax.lax.all_gather(kv, axis_name, axis=0, tiled=True)
    return gathered, jnp.arange(gathered.shape[0], dtype=jnp.int32)


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
        return allgather_kv(kv, axis_name=axis_name)
    if plan.mode == "halo":
        return halo_kv(kv, halo_len=plan.halo_len, axis_name=axis_name, cp_size=plan.cp_size)
    if plan.a2a_impl == "ppermute":
        return needed_kv_ppermute(kv, piece_lens=plan.piece_lens, axis_name=axis_name, cp_size=plan.cp_size)
    return needed_kv_ragged(kv, plan.routing, recv_len=plan.recv_len, send_len=plan.send_len, axis_name=axis_name)
