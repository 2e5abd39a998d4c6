"""How the JAX layers see a packed batch: a ``TokenLayout`` pytree built once, outside ``jax.jit``.

The layers run either on one device (``axis_name=None``, x holds all T tokens) or *inside* a
``jax.shard_map`` over the CP mesh axis (``axis_name="cp"``, x holds this rank's L tokens). The
layout holds the *global* per-token arrays, replicated (in_spec ``P()``); each rank slices its
part by ``lax.axis_index``, so one compiled program serves every packing of the same T::

    seq_idx     int32 [1, T]  GDP sequences (``jax_api.gdp_chunkwise_context_parallel_shard``)
    doc_ids     int32 [T]     attention documents, 0 = padding
    position    int32 [T]     index within the sequence (conv reach, RoPE angle)
    cu_seqlens  int32 [N + 1] GDP sequence offsets on one device, N the static bound below (runs
                past the last are empty sequences at T), so a new packing keeps the shape
    attention_plan            ``BlockDiagExchangePlan`` for the attention exchange (CP only)
    max_shard_sequences       static bound on the GDP sequences of one shard: sizes the chunk
                              layout (``cp_linear.chunking.max_shard_sequences``)
    max_attention_runs        (property) static bound on the runs of equal ``doc_ids`` (padding runs
                              too) of one shard or zig-zag chunk: sizes cuDNN's packed attention
                              (``jax_api.attention.cudnn``)

``cp_linear.packing.PackedLayout`` (numpy, shared with torch) derives the arrays.

Zig-zag (``build_layout(..., layout="zigzag")``, ``cp_linear.zigzag``): rank r holds chunks r and
2·cp−1−r of 2·cp equal chunks, in that order. The arrays above stay in global order; ``local`` takes
the rank's two chunks, so conv and RoPE positions are global; the conv halo is per chunk
(``jax_api.layers.conv.zigzag_conv_windows``), the GDP runs its zig-zag op and attention all-gathers.
The caller feeds rank r the tokens of its chunks (``cp_apply``: ``x[:, layout_permutation(T, cp, "zigzag")]``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cp_linear.chunking import max_shard_sequences
from cp_linear.packing import PackedLayout, layout_from_ids
from cp_linear.zigzag import chunk_length, virtual_shard_count
from jax_api._chunks import local_values


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """Global per-token arrays (data) and static facts (meta: ``packed``, ``cp_size``, ``shard_layout``
    "contiguous" or "zigzag", ``max_shard_sequences``: the bound per shard, per chunk under zig-zag).

    ``cu_seqlens`` int32 [N + 1] serves the one-device GDP (cp_size 1, packed; else None); its
    length is the static bound ``max_shard_sequences`` + 1 (part of the compiled shape, like the
    bound under CP), its values are not: the real sequences, then empty ones at T.
    """

    seq_idx: jax.Array
    doc_ids: jax.Array
    position: jax.Array
    attention_plan: object = None
    packed: bool = True
    cp_size: int = 1
    cu_seqlens: jax.Array | None = None
    max_shard_sequences: int | None = None
    shard_layout: str = "contiguous"

    @property
    def total_len(self) -> int:
        return int(self.doc_ids.shape[0])

    @property
    def max_attention_runs(self) -> int:
        """The GDP sequences are the runs of equal doc ids, so their bound (per shard; per zig-zag chunk)
        bounds the attention's segments too; at least 2: cuDNN reads one segment per row as unpacked."""
        return max(2, self.max_shard_sequences or 1)

    @property
    def local_len(self) -> int:
        return self.total_len // self.cp_size

    @property
    def zigzag(self) -> bool:
        return self.shard_layout == "zigzag"

    @property
    def conv_reach(self) -> int:
        """Most tokens the conv halo may take from before a piece: L (contiguous) or L / 2 (zig-zag chunk)."""
        return self.local_len // 2 if self.zigzag else self.local_len

    def local(self, values: jax.Array, axis_name: str | None) -> jax.Array:
        """This rank's entries of a per-token array [T], in local order (all of it on one device)."""
        if axis_name is None:
            return values
        return local_values(values, axis_name, self.shard_layout)


jax.tree_util.register_dataclass(TokenLayout,
                                 data_fields=["seq_idx", "doc_ids", "position", "attention_plan", "cu_seqlens"],
                                 meta_fields=["packed", "cp_size", "max_shard_sequences", "shard_layout"])


def layout_from_packed(packed: PackedLayout, *, cp_size: int = 1, attention_mode: str = "auto",
                       platform: str | None = None, min_halo_len: int = 0, min_shard_sequences: int = 1,
                       attention_shape=None, layout: str = "contiguous") -> TokenLayout:
    packed.check_cp_size(cp_size)
    chunk_length(packed.total_len, cp_size, layout)  # zig-zag: T divisible by 2·cp, named as such
    # the GDP op's bound is per zig-zag chunk under CP; one device runs the whole sequence whatever the layout
    shards = virtual_shard_count(cp_size, layout) if cp_size > 1 else 1
    plan = bound = cu = None
    if packed.packed:
        bound = max_shard_sequences(packed.seq_idx, shards, floor=min_shard_sequences)
    if cp_size == 1 and packed.packed:
        # padded with empty sequences to the static bound: the number of documents of a packing is
        # not a shape (an [N + 1] array would retrace the one-device program for every new N)
        real = packed.cu_seqlens()
        cu = jnp.asarray(np.pad(real, (0, bound + 1 - real.shape[0]), constant_values=packed.total_len), jnp.int32)
    if cp_size > 1:
        from jax_api.attention.blockdiag import plan_blockdiag_exchange

        plan = plan_blockdiag_exchange(packed.doc_ids, cp_size, mode=attention_mode, platform=platform,
                                       shape=attention_shape, layout=layout)
        if plan.mode == "halo" and plan.halo_len < min_halo_len:
            # extra halo rows hold other documents' tokens, which the doc mask drops; a fixed
            # halo keeps the plan's static shape (and so the compiled program) across packings
            plan = dataclasses.replace(plan, shape=dataclasses.replace(plan.shape, halo_len=min(min_halo_len,
                                                                                              plan.local_len)))
    return TokenLayout(seq_idx=jnp.asarray(packed.seq_idx.reshape(1, -1), jnp.int32),
                       doc_ids=jnp.asarray(packed.doc_ids, jnp.int32),
                       position=jnp.asarray(packed.position, jnp.int32),
                       attention_plan=plan, packed=packed.packed, cp_size=int(cp_size), cu_seqlens=cu,
                       max_shard_sequences=bound, shard_layout=layout)


def build_layout(*, total_len: int, doc_ids=None, seq_idx=None, cu_seqlens=None, cp_size: int = 1,
                 attention_mode: str = "auto", platform: str | None = None, min_halo_len: int = 0,
                 min_shard_sequences: int = 1, attention_shape=None, layout: str = "contiguous") -> TokenLayout:
    """A ``TokenLayout`` from concrete *global* ids (host-read; call outside ``jax.jit``).

    At most one of ``doc_ids`` (int [T], 0 = padding), ``seq_idx`` (int [1, T] nondecreasing),
    ``cu_seqlens`` (int [N + 1]); none: every batch row is one sequence of T tokens. ``cp_size`` > 1
    builds the attention plan for that many ranks (``attention_mode``: auto / allgather / halo / a2a;
    ``platform`` picks the a2a implementation, default ``jax.default_backend()``).

    The attention plan's exchange sizes are static (``jax.jit`` recompiles when they change).
    ``min_halo_len`` pads a halo plan to at least that many tokens: when documents are shorter
    than it, every packing then shares one compiled program (the examples use this).
    ``attention_shape`` fixes the exchange sizes outright (``plan_blockdiag_exchange``'s ``shape``,
    e.g. ``cp_linear.plan.widest_exchange_shape(...)``, which serves every packing).
    Likewise the GDP chunk layout (and the one-device ``cu_seqlens``) is sized for the most
    sequences a shard holds, rounded up to a power of two and at least ``min_shard_sequences``.
    Layouts with the same T, cp_size and static bounds share one compiled program.
    ``layout``: "contiguous" (rank r holds tokens [r·L, (r+1)·L)) or "zigzag" (chunks r and 2·cp−1−r of
    2·cp, ``cp_linear.zigzag``; T divisible by 2·cp, attention all-gathers: ``attention_mode`` "auto" or
    "allgather"); the ids stay in global order either way (module docstring).
    """
    for name, value in (("doc_ids", doc_ids), ("seq_idx", seq_idx), ("cu_seqlens", cu_seqlens)):
        if isinstance(value, jax.core.Tracer):
            raise ValueError(f"{name} is traced: build the TokenLayout outside jax.jit (build_layout) and pass it in")
    host = {name: None if value is None else np.asarray(value)
            for name, value in (("doc_ids", doc_ids), ("seq_idx", seq_idx), ("cu_seqlens", cu_seqlens))}
    packed = layout_from_ids(total_len=total_len, **host)
    return layout_from_packed(packed, cp_size=cp_size, attention_mode=attention_mode, platform=platform,
                              min_halo_len=min_halo_len, min_shard_sequences=min_shard_sequences,
                              attention_shape=attention_shape, layout=layout)


def resolve_layout(x, *, layout, axis_name, doc_ids=None, seq_idx=None, cu_seqlens=None) -> TokenLayout:
    """The layout of a layer call; checks x [B, L, D] against it (trace time, before any collective)."""
    if getattr(x, "ndim", None) != 3:
        raise ValueError(f"hidden_states must be [B, L, D]; received shape {getattr(x, 'shape', None)}")
    cp_size = 1 if axis_name is None else _axis_size(axis_name)
    if layout is None:
        if cp_size > 1:
            raise ValueError("under CP (axis_name given) pass layout=build_layout(..., cp_size=...) built outside "
                             "the shard_map")
        layout = build_layout(total_len=x.shape[1], doc_ids=doc_ids, seq_idx=seq_idx, cu_seqlens=cu_seqlens)
    elif any(v is not None for v in (doc_ids, seq_idx, cu_seqlens)):
        raise ValueError("pass either layout or ids (doc_ids / seq_idx / cu_seqlens), not both")
    if not isinstance(layout, TokenLayout):
        raise ValueError(f"layout must be a TokenLayout (jax_api.layers.build_layout); "
                         f"received {type(layout).__name__}")
    if layout.cp_size != cp_size:
        raise ValueError(f"the layout was built for cp_size = {layout.cp_size}; this call runs over "
                         f"{cp_size} rank(s) (axis_name={axis_name!r})")
    if x.shape[1] != layout.local_len:
        raise ValueError(f"hidden_states must hold L = {layout.local_len} tokens (T = {layout.total_len} over "
                         f"{cp_size} rank(s)); received shape {tuple(x.shape)}")
    if layout.packed and x.shape[0] != 1:
        raise ValueError(f"a packed batch (ids given) needs B = 1; received B = {x.shape[0]}")
    return layout


def _axis_size(axis_name: str) -> int:
    try:
        return jax.lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(f"axis name {axis_name!r} is not bound: call the layer inside a jax.shard_map over a mesh "
                         "with that axis, or pass axis_name=None on one device") from err


__all__ = ["TokenLayout", "build_layout", "layout_from_packed", "resolve_layout"]
