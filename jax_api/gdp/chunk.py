"""Pure-JAX chunkwise Gated DeltaProduct (WY/UT form) and the CP backend built on it.

The layout is ``cp_linear.chunking`` (the one every backend uses): chunks of at most C steps, each
inside one sequence, built from ``cu_seqlens`` with static shapes, so a new packing with the same
number of sequences reuses the compiled program. Chunk-major arrays are [NC, B, H, C, ...].

Per chunk, with G the cumulative gate and the unit lower triangular UT transform
``T = (I + tril(beta_i k_i.k_j exp(G_i - G_j), -1))^-1``::

    w = T diag(beta exp(G)) k      u = T diag(beta) v
    new values = u - w S0
    o_i = scale * (exp(G_i) q_i S0 + sum_j (q_i.k_j) exp(G_i - G_j) new_j)
    S_end = M S0 + E,  M = exp(G_C) I - k_end^T w,  E = k_end^T u

and from chunk to chunk ``S_{c+1} = keep_c (M_c S_c + E_c) + reset_c``: keep is 0 where chunk c + 1
starts a sequence, whose state is then its initial state (zero under CP).
``cp_linear.reference.wy_chunk`` is the float64 version of the same formulas.

Backward: ``jax.vjp`` of a recomputation, split like the forward: ``prepare`` (inputs -> chunk
terms and the summary ``(E, M)``) and ``apply`` (terms, incoming state -> outputs). gamma is the
vjp of the local outputs with respect to the incoming state; the input gradients add the vjp of
the summary with ``dE = dS_out`` and ``dM = dS_out S_in^T``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cp_linear.chunking import CHUNK_SIZE, chunk_layout
from cp_linear.gdp import GDPInputGradients, GDPInputs, L2NORM_EPS, check_gdp_shapes
from cp_linear.protocol import CPForwardResult, CPSavedContext
from cp_linear.summary import (
    CPBackwardPackedSummary,
    CPForwardPackedSummary,
    as_packed_array,
    compose_backward,
    compose_forward,
)
from cp_linear.validation import gdp_dims_error

_HIGHEST = jax.lax.Precision.HIGHEST  # float32 matmuls stay float32 on GPUs too (no TF32)

jax.tree_util.register_dataclass(
    GDPInputs,
    data_fields=["q", "k", "v", "g", "beta", "cu_seqlens", "initial_state", "token_flags"],
    meta_fields=["scale", "num_householder", "use_qk_l2norm_in_kernel", "output_final_state", "save_for_backward"],
)


def _einsum(spec: str, *operands):
    return jnp.einsum(spec, *operands, precision=_HIGHEST)


def l2norm(x: jax.Array) -> jax.Array:
    """x / sqrt(sum(x^2) + L2NORM_EPS) over the last axis (``cp_linear.gdp``)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def match_vma(x: jax.Array, *likes: jax.Array) -> jax.Array:
    """Make ``x`` vary over every shard_map axis that any of ``likes`` varies over.

    A scan carry must keep one type; a zero or identity start is axis-invariant while the
    body's result varies. Adding a zero shaped like each ``like`` (``zeros_like`` keeps its
    varying axes) casts the start without reading private type fields. Free outside shard_map.
    """
    for like in likes:
        x = x + jnp.zeros_like(like, shape=(), dtype=x.dtype)
    return x


def host_value_or_none(x):
    """``x`` as a numpy array, or None when it is traced (no value until the program runs).

    Lets the frontends check concrete ids once on the host and skip the check under jit.
    """
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_gdp_inputs(q, k, v, g, beta, num_householder: int, cu_seqlens=None) -> None:
    """Raise ValueError unless shapes and dtypes follow docs/design.md §2 and the sizes are supported
    (non-empty, K ≤ 256, V ≤ 512: ``cp_linear.validation``); trace-time, static checks.

    q, k, v share one floating dtype; g and beta may use any floating dtype (often float32).
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array; received {type(x).__name__}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must have a floating dtype; received {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share one dtype; received q {q.dtype}, k {k.dtype}, v {v.dtype}")
    check_gdp_shapes(q.shape, k.shape, v.shape, g.shape, beta.shape, num_householder)
    error = gdp_dims_error(q.shape, v.shape)  # empty sizes, K and V limits: the same rule as torch_api
    if error:
        raise ValueError(error)
    if cu_seqlens is not None:
        if getattr(cu_seqlens, "ndim", None) != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be int [N + 1] with N >= 1; received shape "
                             f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
        if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            raise ValueError(f"cu_seqlens must hold integers; received dtype {cu_seqlens.dtype}")
        if q.shape[0] != 1:
            raise ValueError(f"cu_seqlens describes one packed row: B must be 1; received B = {q.shape[0]}")


# --------------------------------------------------------------------------- the layout in chunks


class Placement(NamedTuple):
    """``cp_linear.chunking.ChunkLayout`` as jnp index arrays (traced when cu_seqlens is).

    source  int32 [NC * C] step of every slot (S = padding);  slot  int32 [S] slot of every step
    keep    float32 [NC]  0 where the next chunk starts a sequence;  starts  bool [NC]
    chunk_seq int32 [NC];  first_chunk, last_chunk int32 [N];  nonempty bool [N]
    """

    source: jax.Array
    slot: jax.Array
    keep: jax.Array
    starts: jax.Array
    chunk_seq: jax.Array
    first_chunk: jax.Array
    last_chunk: jax.Array
    nonempty: jax.Array


def placement(inputs: GDPInputs, chunk_size: int) -> Placement:
    """The chunk layout of a shard: of ``inputs.cu_seqlens`` (packed) or of one row (rows)."""
    tokens = inputs.q.shape[1]
    steps = tokens * inputs.num_householder
    cu = inputs.cu_seqlens if inputs.is_packed else jnp.asarray([0, tokens], jnp.int32)
    layout, bounds = chunk_layout(jnp.asarray(cu, jnp.int32), total_steps=steps,
                                  num_householder=inputs.num_householder, chunk_size=chunk_size)
    starts = layout.starts_sequence()
    keep = jnp.concatenate([jnp.logical_not(starts[1:]), jnp.ones((1,), bool)]).astype(jnp.float32)
    return Placement(layout.slot_source(), layout.step_slot(bounds), keep, starts, layout.chunk_seq,
                     layout.first_chunk(), layout.last_chunk(), layout.sequence_nonempty())


def to_chunks(x: jax.Array, where: Placement, chunk_size: int) -> jax.Array:
    """[B, S, H, ...] -> [NC, B, H, C, ...], padding slots zero."""
    padded = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
    gathered = jnp.take(padded, where.source, axis=1)  # [B, NC * C, H, ...]
    chunked = gathered.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])
    return jnp.moveaxis(jnp.moveaxis(chunked, 1, 0), 3, 2)  # [NC, B, H, C, ...]


def from_chunks(y: jax.Array, where: Placement) -> jax.Array:
    """[NC, B, H, C, ...] -> [B, S, H, ...] (drops the padding slots)."""
    per_slot = jnp.moveaxis(jnp.moveaxis(y, 2, 3), 0, 1)  # [B, NC, C, H, ...]
    per_slot = per_slot.reshape(y.shape[1], -1, *per_slot.shape[3:])
    return jnp.take(per_slot, where.slot, axis=1)


def step_arrays(inputs: GDPInputs):
    """q, k, v, g, beta per step [B, S, H, ...], float32, l2-normalised when asked: q on each token's
    last step and g on its first (zeros elsewhere)."""
    batch, tokens, heads, key_dim = inputs.q.shape
    n = inputs.num_householder
    q = inputs.q.astype(jnp.float32)
    k = inputs.k.astype(jnp.float32)
    if inputs.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q_steps = jnp.concatenate([jnp.zeros((batch, tokens, n - 1, heads, key_dim), q.dtype), q[:, :, None]], axis=2)
    g = inputs.g.astype(jnp.float32)
    g_steps = jnp.concatenate([g[:, :, None], jnp.zeros((batch, tokens, n - 1, heads), g.dtype)], axis=2)
    return (q_steps.reshape(batch, tokens * n, heads, key_dim), k, inputs.v.astype(jnp.float32),
            g_steps.reshape(batch, tokens * n, heads), inputs.beta.astype(jnp.float32))


# --------------------------------------------------------------------------- per-chunk math


def unit_lower_inverse(strict_lower: jax.Array) -> jax.Array:
    """``(I + A)^-1`` for strictly lower triangular A [..., C, C], by blocked forward substitution.

    Inverses of the diagonal blocks double in size each round (1, 2, 4, ...):
    ``[[X1, 0], [A21, X2]]^-1 = [[X1, 0], [-X2 A21 X1, X2]]``, so it is log2(C) rounds of batched
    matmuls. ``lax.linalg.triangular_solve`` is not used: on XLA:CPU its LAPACK kernel splits the
    batch over the same thread pool that runs the host devices and waits on it, which deadlocks
    a multi-device CPU mesh once the batch is large (seen with 4 host devices, 256 tokens).
    """
    chunk = strict_lower.shape[-1]
    size = 1 << (chunk - 1).bit_length()
    batch = strict_lower.shape[:-2]
    if size != chunk:  # pad to a power of two with identity rows
        strict_lower = jnp.pad(strict_lower, [(0, 0)] * len(batch) + [(0, size - chunk)] * 2)
    inverse = jnp.ones(batch + (size, 1, 1), strict_lower.dtype)  # [..., blocks, b, b]
    block = 1
    while block < size:
        pairs = size // (2 * block)
        # the lower-left b x b block of each diagonal 2b x 2b block: [..., pairs, b, b]
        tiles = strict_lower.reshape(batch + (pairs, 2, block, pairs, 2, block))[..., :, 1, :, :, 0, :]
        below = _einsum("...pxqy,pq->...pxy", tiles, jnp.eye(pairs, dtype=strict_lower.dtype))
        upper, lower = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        corner = -_einsum("...ij,...jk,...kl->...il", lower, below, upper)
        inverse = jnp.concatenate([jnp.concatenate([upper, jnp.zeros_like(corner)], axis=-1),
                                   jnp.concatenate([corner, lower], axis=-1)], axis=-2)
        block *= 2
    return inverse[..., 0, :chunk, :chunk]


class ChunkTerms(NamedTuple):
    """Per-chunk WY/UT quantities, float32, chunk-major [NC, B, H, C, ...]."""

    q: jax.Array  # [NC, B, H, C, K]
    w: jax.Array  # [NC, B, H, C, K]   how the chunk's incoming state enters the new values
    u: jax.Array  # [NC, B, H, C, V]   new values from a zero incoming state
    gate: jax.Array  # [NC, B, H, C]   exp(G)
    attention: jax.Array  # [NC, B, H, C, C]   (q_i . k_j) exp(G_i - G_j), causal
    transition: jax.Array  # [NC, B, H, K, K]   M of the chunk
    update: jax.Array  # [NC, B, H, K, V]   E of the chunk


def _masked_exp(x: jax.Array, mask) -> jax.Array:
    """exp(x) where mask, else 0, without overflow (or NaN gradients) from the masked entries."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def chunk_terms(q, k, v, g, beta) -> ChunkTerms:
    """Every chunk's WY/UT quantities at once; inputs chunk-major [NC, B, H, C, ...] float32."""
    chunk_size, key_dim = k.shape[-2], k.shape[-1]
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    strict = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)
    cum = jnp.cumsum(g, axis=-1)  # G, [NC, B, H, C]
    decay = _masked_exp(cum[..., :, None] - cum[..., None, :], causal)
    gate = jnp.exp(cum)
    lower = jnp.where(strict, beta[..., :, None] * _einsum("...ik,...jk->...ij", k, k) * decay, 0.0)
    rhs = jnp.concatenate([(beta * gate)[..., None] * k, beta[..., None] * v], axis=-1)
    solved = _einsum("...ij,...jm->...im", unit_lower_inverse(lower), rhs)
    w, u = solved[..., :key_dim], solved[..., key_dim:]
    k_end = jnp.exp(cum[..., -1:] - cum)[..., None] * k
    eye = jnp.eye(key_dim, dtype=jnp.float32)
    transition = gate[..., -1, None, None] * eye - _einsum("...ck,...cl->...kl", k_end, w)
    update = _einsum("...ck,...cv->...kv", k_end, u)
    attention = _einsum("...ik,...jk->...ij", q, k) * decay
    return ChunkTerms(q, w, u, gate, attention, transition, update)


# --------------------------------------------------------------------------- recurrences over chunks


def _kept(terms: ChunkTerms, keep: jax.Array, resets: jax.Array | None):
    """(transition, update) with ``keep`` applied and the reset states added: S' = M S + E."""
    scale = keep[:, None, None, None, None]
    update = terms.update * scale
    return terms.transition * scale, update if resets is None else update + resets


def chunk_start_states(terms: ChunkTerms, entering: jax.Array, keep: jax.Array,
                       resets: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """State entering each chunk [NC, B, H, K, V] and the state after the last one [B, H, K, V]."""
    transition, update = _kept(terms, keep, resets)
    carry = match_vma(entering.astype(jnp.float32), transition, update)

    def advance(state, chunk):
        return _einsum("bhkl,bhlv->bhkv", chunk[0], state) + chunk[1], state

    final, starts = jax.lax.scan(advance, carry, (transition, update))
    return starts, final


def fold_summary(terms: ChunkTerms, keep: jax.Array, resets: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
    """(E [B, H, K, V], M [B, H, K, K]) of all chunks in order: the shard's forward summary."""
    transition, update = _kept(terms, keep, resets)
    _, batch, heads, key_dim, value_dim = update.shape
    update0 = match_vma(jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32), update)
    transition0 = match_vma(jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (batch, heads, key_dim, key_dim)),
                            transition)

    def fold(carry, chunk):
        state_update, state_transition = carry
        return (_einsum("bhkl,bhlv->bhkv", chunk[0], state_update) + chunk[1],
                _einsum("bhkl,bhlm->bhkm", chunk[0], state_transition)), None

    (update, transition), _ = jax.lax.scan(fold, (update0, transition0), (transition, update))
    return update, transition


def chunk_outputs(terms: ChunkTerms, states: jax.Array, scale: float) -> jax.Array:
    """Outputs of every slot [NC, B, H, C, V] given the state entering each chunk [NC, B, H, K, V]."""
    new_values = terms.u - _einsum("...ck,...kv->...cv", terms.w, states)
    inter = terms.gate[..., None] * _einsum("...ck,...kv->...cv", terms.q, states)
    intra = _einsum("...ij,...jv->...iv", terms.attention, new_values)
    return scale * (inter + intra)


# --------------------------------------------------------------------------- one shard


@dataclass(frozen=True)
class _Shard:
    """A shard's inputs with its layout: the helpers of prepare and apply."""

    inputs: GDPInputs
    chunk_size: int

    @property
    def where(self) -> Placement:
        return placement(self.inputs, self.chunk_size)

    def summary_form(self, x: jax.Array) -> jax.Array:
        """[B, H, ...] recurrence coordinates -> the summary's form ([H, ...] for a packed row)."""
        return x[0] if self.inputs.is_packed else x

    def recurrence_form(self, x: jax.Array) -> jax.Array:
        return x[None] if self.inputs.is_packed else x

    def entering(self, initial: jax.Array, where: Placement) -> jax.Array:
        """[N, H, K, V] -> the initial state chunk 0 continues [B, H, K, V]."""
        return jnp.take(initial, where.chunk_seq[:1], axis=0) if self.inputs.is_packed else initial

    def resets(self, initial: jax.Array | None, where: Placement) -> jax.Array | None:
        """[N, H, K, V] -> [NC, B, H, K, V]: the state of the sequence starting at chunk c + 1 (else 0)."""
        if initial is None or not self.inputs.is_packed:
            return None
        starting = jnp.take(initial, where.chunk_seq[1:], axis=0) * where.starts[1:, None, None, None]
        return jnp.concatenate([starting, jnp.zeros_like(initial[:1])], axis=0)[:, None]

    def terms(self, q, k, v, g, beta) -> ChunkTerms:
        """The chunk terms of the inputs; differentiable in every argument."""
        inputs = GDPInputs(q, k, v, g, beta, self.inputs.scale, self.inputs.num_householder,
                           self.inputs.use_qk_l2norm_in_kernel, self.inputs.cu_seqlens)
        return chunk_terms(*(to_chunks(x, self.where, self.chunk_size) for x in step_arrays(inputs)))

    def summary(self, terms: ChunkTerms, initial):
        """-> (E, M) in recurrence coordinates: the forward summary of the chunks."""
        where = self.where
        return fold_summary(terms, where.keep, self.resets(initial, where))

    def apply(self, terms: ChunkTerms, incoming: jax.Array, initial):
        """-> (o float32 [B, T, H, V], final states [N, H, K, V] or None) from the incoming state."""
        where = self.where
        states, after = chunk_start_states(terms, self.recurrence_form(incoming), where.keep,
                                           self.resets(initial, where))
        per_step = from_chunks(chunk_outputs(terms, states, self.inputs.scale), where)  # [B, S, H, V]
        batch, tokens = self.inputs.q.shape[:2]
        n = self.inputs.num_householder
        output = per_step.reshape(batch, tokens, n, *per_step.shape[2:])[:, :, n - 1]
        if not self.inputs.output_final_state:
            return output, None
        if not self.inputs.is_packed:
            return output, after
        start = jnp.zeros(self.inputs.state_shape, jnp.float32) if initial is None else initial
        last = where.last_chunk  # a sequence ends in its last chunk's end state; an empty one in its start
        ends = _einsum("nhkl,nhlv->nhkv", terms.transition[last, 0], states[last, 0]) + terms.update[last, 0]
        return output, jnp.where(where.nonempty[:, None, None, None], ends, start)


# --------------------------------------------------------------------------- the CP backend


@dataclass(frozen=True)
class JaxGDPLocalContext:
    """What ``cp_forward_apply`` needs: the shard, its chunk terms and its initial states."""

    shard: _Shard
    terms: ChunkTerms
    initial: jax.Array | None


@dataclass(frozen=True)
class JaxGDPBackwardContext:
    """What ``cp_backward_apply`` needs; lives only inside one backward trace."""

    terms_vjp: Callable[[Any], tuple[jax.Array, ...]]  # cotangent of the chunk terms -> input grads
    summary_vjp: Callable[[Any], tuple[Any, ...]]  # cotangents of (E, M) -> (terms, initial state)
    terms_grad: ChunkTerms
    incoming: jax.Array  # summary form, float32
    initial_grad: jax.Array | None  # from the outputs and final states (apply), [N, H, K, V]
    incoming_grad: jax.Array  # gamma: d(local loss) / d(incoming state), summary form
    shard: _Shard
    transition: jax.Array | None = None  # M of the forward summary, recurrence form (CP with initial states)


def _initial(inputs: GDPInputs) -> jax.Array | None:
    if inputs.initial_state is None:
        return None
    if tuple(inputs.initial_state.shape) != inputs.state_shape:
        raise ValueError(f"initial_state must be [N, H, K, V] = {inputs.state_shape}; received "
                         f"{tuple(inputs.initial_state.shape)}")
    return inputs.initial_state.astype(jnp.float32)


def _stack_count(stacked) -> int:
    return int(as_packed_array(stacked).shape[0])


@dataclass(frozen=True)
class JaxGDPBackend:
    """The four-function CP protocol (``cp_linear.protocol``) in pure JAX, float32 state.

    Runs anywhere XLA does (CPU, GPU), eagerly or under jit and shard_map. Summaries are
    ``[H, K, V + K]`` for a packed shard (``cu_seqlens`` given) and ``[B, H, K, V + K]``
    otherwise; ``preceding`` / ``following`` are stacks ``[n, ...]`` of them (n >= 0). Supports the
    sequence states of ``cp_linear.gdp.GDPInputs`` (the one-device op uses them).
    ``chunk_size`` counts interleaved steps; small values only serve tests.
    """

    chunk_size: int = CHUNK_SIZE
    supports_sequence_states = True

    def __post_init__(self):
        if not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int; received {self.chunk_size!r}")

    def cp_forward_prepare(self, inputs: GDPInputs) -> tuple[CPForwardPackedSummary, JaxGDPLocalContext]:
        shard, initial = _Shard(inputs, self.chunk_size), _initial(inputs)
        terms = shard.terms(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)
        update, transition = shard.summary(terms, initial)
        summary = shard.summary_form(jnp.concatenate([update, transition], axis=-1))
        return CPForwardPackedSummary(summary), JaxGDPLocalContext(shard, terms, initial)

    def cp_forward_apply(self, local_context: JaxGDPLocalContext, preceding) -> CPForwardResult:
        shard, initial = local_context.shard, local_context.initial
        inputs = shard.inputs
        saved = self.saved_context(inputs, preceding)
        output, final = shard.apply(local_context.terms, saved.tensors[6], initial)
        output = output.astype(inputs.q.dtype)
        return CPForwardResult((output, final) if inputs.output_final_state else output, saved)

    def saved_context(self, inputs: GDPInputs, preceding) -> CPSavedContext:
        """What ``cp_forward_apply`` saves for ``cp_backward_prepare``: the inputs and the state entering
        the shard's first chunk (``preceding`` folded from the initial state of the sequence that chunk
        belongs to). A backend whose backward is this one saves the same (the CuTeDSL kernels' default)."""
        shard, initial = _Shard(inputs, self.chunk_size), _initial(inputs)
        # under CP the preceding summaries are folded from the initial state of the sequence chunk 0
        # continues (summaries never carry it; a frontend passes that sequence's S0 on every rank it spans)
        start = None if initial is None else shard.summary_form(shard.entering(initial, shard.where))
        incoming = compose_forward(preceding, start).astype(jnp.float32)
        return CPSavedContext(
            tensors=(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.cu_seqlens, incoming, initial),
            metadata={"scale": inputs.scale, "num_householder": inputs.num_householder,
                      "use_qk_l2norm_in_kernel": inputs.use_qk_l2norm_in_kernel,
                      "output_final_state": inputs.output_final_state})

    def cp_backward_prepare(self, output_grad, saved_context: CPSavedContext
                            ) -> tuple[CPBackwardPackedSummary, JaxGDPBackwardContext]:
        q, k, v, g, beta, cu_seqlens, incoming, initial = saved_context.tensors
        inputs = GDPInputs(q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=initial, **saved_context.metadata)
        shard = _Shard(inputs, self.chunk_size)
        output_grad, final_grad = output_grad if inputs.output_final_state else (output_grad, None)
        terms, terms_vjp = jax.vjp(shard.terms, q, k, v, g, beta)
        (_, transition), summary_vjp = jax.vjp(shard.summary, terms, initial)
        (output, final), apply_vjp = jax.vjp(lambda t, s, i: shard.apply(t, s, i), terms, incoming, initial)
        final_cotangent = None if final is None else final_grad.astype(jnp.float32)
        terms_grad, incoming_grad, initial_grad = apply_vjp((output_grad.astype(jnp.float32), final_cotangent))
        summary = jnp.concatenate([incoming_grad, shard.summary_form(jnp.swapaxes(transition, -1, -2))], axis=-1)
        context = JaxGDPBackwardContext(terms_vjp, summary_vjp, terms_grad, incoming, initial_grad, incoming_grad,
                                        shard, transition)
        return CPBackwardPackedSummary(summary), context

    def cp_backward_apply(self, backward_context: JaxGDPBackwardContext, following) -> GDPInputGradients:
        ctx = backward_context
        shard = ctx.shard
        inputs = shard.inputs
        terms_grad = ctx.terms_grad
        summary_initial_grad, outgoing = None, None
        if _stack_count(following) > 0:  # static: one device (no rank after) skips the summary's vjp
            outgoing_grad = match_vma(compose_backward(following).astype(jnp.float32), ctx.incoming)
            incoming = shard.recurrence_form(ctx.incoming)
            outgoing = shard.recurrence_form(outgoing_grad)
            # S_out = M S_in + E, so dE = dS_out and dM = dS_out S_in^T.
            transition_grad = _einsum("bhkv,bhlv->bhkl", outgoing, incoming)
            summary_terms_grad, summary_initial_grad = ctx.summary_vjp((outgoing, transition_grad))
            terms_grad = jax.tree.map(jnp.add, terms_grad, summary_terms_grad)
        grads = ctx.terms_vjp(terms_grad)
        dtypes = (inputs.q.dtype, inputs.k.dtype, inputs.v.dtype, inputs.g.dtype, inputs.beta.dtype)
        grads = [grad.astype(dtype) for grad, dtype in zip(grads, dtypes)]
        if inputs.initial_state is None:
            return GDPInputGradients(*grads)
        # the sequence chunk 0 continues starts from the incoming state: its gradient is gamma plus, under
        # CP, M^T dS_out (S_out = M S_in + E); the summary's own dependence on initial states (sequences
        # starting inside the shard) comes back through its vjp
        entering_grad = shard.recurrence_form(ctx.incoming_grad)
        if outgoing is not None:
            entering_grad = entering_grad + _einsum("bhkl,bhkv->bhlv", ctx.transition, outgoing)
        if inputs.is_packed:
            entering_grad = jnp.zeros(inputs.state_shape, jnp.float32).at[shard.where.chunk_seq[0]].add(
                entering_grad[0])
        initial_grad = ctx.initial_grad + entering_grad
        if summary_initial_grad is not None:
            initial_grad = initial_grad + summary_initial_grad
        return GDPInputGradients(*grads, initial_grad.astype(inputs.initial_state.dtype))
