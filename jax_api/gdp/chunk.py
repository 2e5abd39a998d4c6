"""Pure-JAX chunkwise Gated DeltaProduct (WY/UT form) and the CP backend built on it.

Vocabulary (DESIGN.md §2)
  step        GDP over T tokens is a gated delta rule over T*n_h *steps*: the gate g[t] sits on
              step t*n_h, q[t] is read on step t*n_h + n_h - 1
  chunk       ``chunk_size`` consecutive steps (64 by default) handled by dense matmuls; the
              last chunk of a shard is padded with identity steps (k = v = beta = g = 0)
  segment     the steps of one sequence inside a chunk. A token flagged in ``sequence_starts``
              resets the state; decay and the UT transform act within a segment only, the
              state entering a chunk reaches only its first segment, and the chunk's end state
              comes only from its last segment. Flags are data, not shapes: a new packing reuses
              the compiled program.
  summary     ``[E | M]`` float32: the shard's trailing fragment ends in ``M S_in + E``

Per chunk, with G the cumulative gate and the unit lower triangular UT transform
``T = (I + tril(beta_i k_i.k_j exp(G_i - G_j), -1))^-1`` (masked to equal segments)::

    w = T diag(beta exp(G) [first segment]) k      u = T diag(beta) v
    new values = u - w S0
    o_i = scale * (exp(G_i) [first segment] q_i S0 + sum_j (q_i.k_j) exp(G_i - G_j) new_j)
    S_end = M S0 + E,  M = exp(G_C) [no reset] I - k_end^T w,  E = k_end^T u

``cp_linear.reference.wy_chunk`` is the float64 version of the same formulas.

Example: a shard of 6 tokens, n_h = 2, chunk_size = 8, sequence_starts = [0 0 0 1 0 0]::

    step     0 1 2 3 4 5 6 7 | 8 9 10 11 (12..15 padding)
    segment  0 0 0 0 0 0 1 1 | 0 0  0  0
    chunk 0 reads S_in on steps 0-5 and passes on the state of steps 6-7; M = 0.

Backward: ``jax.vjp`` of a recomputation of the forward (prepare, then apply). gamma is the
vjp of the local outputs with respect to the incoming state at zero outgoing state-gradient;
the input gradients add the vjp of the summary ``(E, M)`` with ``dE = dS_out``,
``dM = dS_out S_in^T``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cp_linear.protocol import CPForwardResult, CPSavedContext
from cp_linear.reference import check_gdp_shapes
from cp_linear.validation import gdp_dims_error
from cp_linear.summary import (
    CPBackwardPackedSummary,
    CPForwardPackedSummary,
    compose_backward,
    compose_forward,
)
from jax_api.gdp.naive import l2norm

DEFAULT_CHUNK_SIZE = 64
_HIGHEST = jax.lax.Precision.HIGHEST  # float32 matmuls stay float32 on GPUs too (no TF32)


def _einsum(spec: str, *operands):
    return jnp.einsum(spec, *operands, precision=_HIGHEST)


def match_vma(x: jax.Array, *likes: jax.Array) -> jax.Array:
    """Make ``x`` vary over every shard_map axis that any of ``likes`` varies over.

    A scan carry must keep one type; a zero or identity start is axis-invariant while the
    body's result varies. Adding a zero shaped like each ``like`` (``zeros_like`` keeps its
    varying axes) casts the start without reading private type fields. Free outside shard_map.
    """
    for like in likes:
        x = x + jnp.zeros_like(like, shape=(), dtype=x.dtype)
    return x


# --------------------------------------------------------------------------- inputs and validation


def host_value_or_none(x):
    """``x`` as a numpy array, or None when it is traced (no value until the program runs).

    Lets the frontends check concrete ids once on the host and skip the check under jit.
    """
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q", "k", "v", "g", "beta", "sequence_starts"],
    meta_fields=["scale", "num_householder", "use_qk_l2norm_in_kernel"],
)
@dataclass(frozen=True)
class JaxGDPInputs:
    """One shard of a GDP layer (DESIGN.md §2 layouts).

    q     [B, T, H, K]
    k     [B, T*n_h, H, K]      the j-th key of token t at index t*n_h + j
    v     [B, T*n_h, H, V]
    g     [B, T, H]             natural-log decay, applied once per token
    beta  [B, T*n_h, H]
    sequence_starts  bool [1, T]: True where a new sequence begins inside the shard (packed
                     batch, B = 1; a flag on token 0 is ignored because the incoming state
                     always belongs to the shard's first sequence), or None when each batch row
                     continues one sequence.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array
    scale: float
    sequence_starts: jax.Array | None = None
    num_householder: int = 1
    use_qk_l2norm_in_kernel: bool = False

    @property
    def is_packed(self) -> bool:
        return self.sequence_starts is not None


class JaxGDPInputGradients(NamedTuple):
    """Gradients with the shapes and dtypes of the matching ``JaxGDPInputs`` fields."""

    dq: jax.Array
    dk: jax.Array
    dv: jax.Array
    dg: jax.Array
    dbeta: jax.Array


def check_gdp_inputs(q, k, v, g, beta, num_householder: int, sequence_starts=None) -> None:
    """Raise ValueError unless shapes and dtypes follow DESIGN.md §2 and the sizes are supported
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
    if sequence_starts is not None:
        expected = (1, q.shape[1])
        if tuple(sequence_starts.shape) != expected or sequence_starts.dtype != jnp.bool_:
            raise ValueError(f"sequence_starts must be bool {expected} (packed batch, B = 1); received "
                             f"{sequence_starts.dtype} {tuple(sequence_starts.shape)} for q {tuple(q.shape)}")


# --------------------------------------------------------------------------- the chunked algorithm


class StepInputs(NamedTuple):
    """Inputs laid out per head and step, float32: [B, H, S, ...] with S = T*n_h."""

    q: jax.Array  # [B, H, S, K], q[t] on step t*n_h + n_h - 1, zeros elsewhere
    k: jax.Array  # [B, H, S, K]
    v: jax.Array  # [B, H, S, V]
    g: jax.Array  # [B, H, S], g[t] on step t*n_h, zeros elsewhere
    beta: jax.Array  # [B, H, S]
    resets: jax.Array | None  # bool [B, S]: the state is zeroed before this step


class ChunkTerms(NamedTuple):
    """Per-chunk WY/UT quantities, float32, [B, H, N, C, ...] with N chunks of C steps."""

    q: jax.Array  # [B, H, N, C, K]
    w: jax.Array  # [B, H, N, C, K]   how the chunk's incoming state enters the new values
    u: jax.Array  # [B, H, N, C, V]   new values from a zero incoming state
    gate: jax.Array  # [B, H, N, C]   exp(G), zero outside the chunk's first segment
    attention: jax.Array  # [B, H, N, C, C]   (q_i . k_j) exp(G_i - G_j), causal, same segment
    transition: jax.Array  # [B, H, N, K, K]   M of the chunk
    update: jax.Array  # [B, H, N, K, V]   E of the chunk


def step_layout(inputs: JaxGDPInputs) -> StepInputs:
    """Interleave tokens into steps, apply the optional l2norm, cast to float32, heads first."""
    batch, tokens, heads, key_dim = inputs.q.shape
    n = inputs.num_householder
    q = inputs.q.astype(jnp.float32)
    k = inputs.k.astype(jnp.float32)
    if inputs.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q_steps = jnp.concatenate([jnp.zeros((batch, tokens, n - 1, heads, key_dim), q.dtype), q[:, :, None]], axis=2)
    g = inputs.g.astype(jnp.float32)
    g_steps = jnp.concatenate([g[:, :, None], jnp.zeros((batch, tokens, n - 1, heads), g.dtype)], axis=2)
    resets = None
    if inputs.sequence_starts is not None:
        starts = inputs.sequence_starts.at[:, 0].set(False)  # the incoming state owns token 0
        resets = jnp.concatenate([starts[:, :, None], jnp.zeros((batch, tokens, n - 1), bool)], axis=2)
        resets = resets.reshape(batch, tokens * n)

    def heads_first(x):
        return jnp.moveaxis(x.reshape(batch, tokens * n, *x.shape[3:]), 2, 1)

    return StepInputs(
        q=heads_first(q_steps),
        k=jnp.moveaxis(k, 2, 1),
        v=jnp.moveaxis(inputs.v.astype(jnp.float32), 2, 1),
        g=heads_first(g_steps),
        beta=jnp.moveaxis(inputs.beta.astype(jnp.float32), 2, 1),
        resets=resets,
    )


def _masked_exp(x: jax.Array, mask) -> jax.Array:
    """exp(x) where mask, else 0, without overflow (or NaN gradients) from the masked entries."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


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


def chunk_terms(steps: StepInputs, chunk_size: int) -> ChunkTerms:
    """Pad the steps to whole chunks and compute every chunk's WY/UT quantities at once."""
    batch, heads, num_steps, key_dim = steps.k.shape
    padded = -(-num_steps // chunk_size) * chunk_size
    pad = padded - num_steps

    def chunked(x):  # [B, H, S, ...] -> [B, H, N, C, ...]
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        return x.reshape(batch, heads, padded // chunk_size, chunk_size, *x.shape[3:])

    q, k, v, g, beta = (chunked(x) for x in steps[:5])
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    strict = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)
    if steps.resets is None:
        within, first_segment, last_segment = causal, True, True
    else:
        resets = jnp.pad(steps.resets, [(0, 0), (0, pad)]).reshape(batch, 1, -1, chunk_size)
        segment = jnp.cumsum(resets.astype(jnp.int32), axis=-1)  # [B, 1, N, C]; 0 = first segment
        within = causal & (segment[..., :, None] == segment[..., None, :])
        first_segment = segment == 0
        last_segment = segment == segment[..., -1:]
    cum = jnp.cumsum(g, axis=-1)  # G, [B, H, N, C]
    decay = _masked_exp(cum[..., :, None] - cum[..., None, :], within)
    gate = _masked_exp(cum, first_segment)
    end_decay = _masked_exp(cum[..., -1:] - cum, last_segment)
    lower = jnp.where(strict, beta[..., :, None] * _einsum("...ik,...jk->...ij", k, k) * decay, 0.0)
    rhs = jnp.concatenate([(beta * gate)[..., None] * k, beta[..., None] * v], axis=-1)
    solved = _einsum("...ij,...jm->...im", unit_lower_inverse(lower), rhs)
    w, u = solved[..., :key_dim], solved[..., key_dim:]
    k_end = end_decay[..., None] * k
    eye = jnp.eye(key_dim, dtype=jnp.float32)
    transition = gate[..., -1, None, None] * eye - _einsum("...ck,...cl->...kl", k_end, w)
    update = _einsum("...ck,...cv->...kv", k_end, u)
    attention = _einsum("...ik,...jk->...ij", q, k) * decay
    return ChunkTerms(q, w, u, gate, attention, transition, update)


def fold_chunk_summaries(terms: ChunkTerms) -> tuple[jax.Array, jax.Array]:
    """(E [B, H, K, V], M [B, H, K, K]) of all chunks in order: the shard's forward summary."""
    batch, heads, _, key_dim, value_dim = terms.update.shape
    update0 = match_vma(jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32), terms.update)
    transition0 = match_vma(jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (batch, heads, key_dim, key_dim)),
                            terms.transition)

    def fold(carry, chunk):
        update, transition = carry
        chunk_transition, chunk_update = chunk
        return (_einsum("bhkl,bhlv->bhkv", chunk_transition, update) + chunk_update,
                _einsum("bhkl,bhlm->bhkm", chunk_transition, transition)), None

    xs = (jnp.moveaxis(terms.transition, 2, 0), jnp.moveaxis(terms.update, 2, 0))
    (update, transition), _ = jax.lax.scan(fold, (update0, transition0), xs)
    return update, transition


class ChunkRestarts(NamedTuple):
    """Chunks that begin a new sequence from its own initial state (one-device varlen path)."""

    flags: jax.Array  # bool [N]: chunk n starts a sequence
    index: jax.Array  # int [N]: which initial state it starts from
    states: jax.Array  # float32 [num_sequences, B, H, K, V]


def chunk_start_states(terms: ChunkTerms, incoming: jax.Array,
                       restarts: ChunkRestarts | None = None) -> tuple[jax.Array, jax.Array]:
    """State entering each chunk [B, H, N, K, V] and the state after the last chunk [B, H, K, V]."""
    likes = (terms.transition, terms.update) + (() if restarts is None else (restarts.states,))
    carry = match_vma(incoming.astype(jnp.float32), *likes)
    xs = (jnp.moveaxis(terms.transition, 2, 0), jnp.moveaxis(terms.update, 2, 0))
    if restarts is not None:
        xs = xs + (restarts.flags, restarts.index)

    def advance(state, chunk):
        if restarts is not None:
            state = jnp.where(chunk[2], restarts.states[chunk[3]], state)
        return _einsum("bhkl,bhlv->bhkv", chunk[0], state) + chunk[1], state

    final, starts = jax.lax.scan(advance, carry, xs)
    return jnp.moveaxis(starts, 0, 2), final


def chunk_outputs(terms: ChunkTerms, states: jax.Array, scale: float) -> jax.Array:
    """Outputs of every step [B, H, N*C, V] given the state entering each chunk [B, H, N, K, V]."""
    new_values = terms.u - _einsum("...ck,...kv->...cv", terms.w, states)
    inter = terms.gate[..., None] * _einsum("...ck,...kv->...cv", terms.q, states)
    intra = _einsum("...ij,...jv->...iv", terms.attention, new_values)
    out = scale * (inter + intra)
    return out.reshape(*out.shape[:2], -1, out.shape[-1])


def token_outputs(step_outputs: jax.Array, tokens: int, num_householder: int) -> jax.Array:
    """[B, H, >= T*n_h, V] per step -> [B, T, H, V], read on each token's last step."""
    batch, heads, _, value_dim = step_outputs.shape
    per_token = step_outputs[:, :, : tokens * num_householder].reshape(batch, heads, tokens, num_householder, value_dim)
    return jnp.moveaxis(per_token[:, :, :, -1], 1, 2)


# --------------------------------------------------------------------------- the CP backend


@dataclass(frozen=True)
class JaxGDPLocalContext:
    """What ``cp_forward_apply`` needs: the shard's inputs and its chunk terms."""

    inputs: JaxGDPInputs
    terms: ChunkTerms


@dataclass(frozen=True)
class JaxGDPBackwardContext:
    """What ``cp_backward_apply`` needs; lives only inside one backward trace."""

    prepare_vjp: Callable[[Any], tuple[jax.Array, ...]]  # cotangents of (terms, E, M) -> input grads
    terms_grad: ChunkTerms
    incoming: jax.Array  # [B, H, K, V] float32
    input_dtypes: tuple[Any, ...]
    is_packed: bool


def _prepare(inputs: JaxGDPInputs, chunk_size: int) -> tuple[ChunkTerms, jax.Array, jax.Array]:
    terms = chunk_terms(step_layout(inputs), chunk_size)
    update, transition = fold_chunk_summaries(terms)
    return terms, update, transition


def _apply(terms: ChunkTerms, incoming: jax.Array, inputs: JaxGDPInputs) -> jax.Array:
    """float32 [B, T, H, V] outputs of the shard from its incoming state [B, H, K, V]."""
    states, _ = chunk_start_states(terms, incoming)
    step_outputs = chunk_outputs(terms, states, inputs.scale)
    return token_outputs(step_outputs, inputs.q.shape[1], inputs.num_householder)


def _pack(left: jax.Array, transition_part: jax.Array, is_packed: bool) -> jax.Array:
    packed = jnp.concatenate([left, transition_part], axis=-1)  # [B, H, K, V + K]
    return packed[0] if is_packed else packed


def _fold_neighbours(stacked, compose, is_packed: bool) -> jax.Array:
    """Fold stacked neighbour summaries into a state [B, H, K, V] (float32)."""
    state = compose(stacked).astype(jnp.float32)
    return state[None] if is_packed else state


@dataclass(frozen=True)
class JaxGDPBackend:
    """The four-function CP protocol (``cp_linear.protocol``) in pure JAX, float32 state.

    Runs anywhere XLA does (CPU, GPU), eagerly or under jit and shard_map. Summaries are
    ``[H, K, V + K]`` for a packed shard (``sequence_starts`` given) and ``[B, H, K, V + K]``
    otherwise; ``preceding`` / ``following`` are stacks ``[n, ...]`` of them (n ≥ 0).
    ``chunk_size`` counts interleaved steps; small values only serve tests.
    """

    chunk_size: int = DEFAULT_CHUNK_SIZE

    def __post_init__(self):
        if not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int; received {self.chunk_size!r}")

    def cp_forward_prepare(self, inputs: JaxGDPInputs) -> tuple[CPForwardPackedSummary, JaxGDPLocalContext]:
        terms, update, transition = _prepare(inputs, self.chunk_size)
        summary = _pack(update, transition, inputs.is_packed)
        return CPForwardPackedSummary(summary), JaxGDPLocalContext(inputs, terms)

    def cp_forward_apply(self, local_context: JaxGDPLocalContext, preceding) -> CPForwardResult:
        inputs = local_context.inputs
        incoming = _fold_neighbours(preceding, compose_forward, inputs.is_packed)
        output = _apply(local_context.terms, incoming, inputs).astype(inputs.q.dtype)
        saved = CPSavedContext(
            tensors=(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.sequence_starts, incoming),
            metadata={"scale": inputs.scale, "num_householder": inputs.num_householder,
                      "use_qk_l2norm_in_kernel": inputs.use_qk_l2norm_in_kernel},
        )
        return CPForwardResult(output, saved)

    def cp_backward_prepare(self, output_grad: jax.Array, saved_context: CPSavedContext
                            ) -> tuple[CPBackwardPackedSummary, JaxGDPBackwardContext]:
        q, k, v, g, beta, sequence_starts, incoming = saved_context.tensors
        inputs = JaxGDPInputs(q, k, v, g, beta, sequence_starts=sequence_starts, **saved_context.metadata)

        def prepare(*differentiable):
            fields = dict(zip(("q", "k", "v", "g", "beta"), differentiable))
            return _prepare(dataclasses.replace(inputs, **fields), self.chunk_size)

        (terms, _, transition), prepare_vjp = jax.vjp(prepare, q, k, v, g, beta)
        _, apply_vjp = jax.vjp(lambda t, s: _apply(t, s, inputs), terms, incoming)
        terms_grad, local_state_grad = apply_vjp(output_grad.astype(jnp.float32))
        summary = _pack(local_state_grad, jnp.swapaxes(transition, -1, -2), inputs.is_packed)
        context = JaxGDPBackwardContext(prepare_vjp, terms_grad, incoming,
                                        tuple(x.dtype for x in (q, k, v, g, beta)), inputs.is_packed)
        return CPBackwardPackedSummary(summary), context

    def cp_backward_apply(self, backward_context: JaxGDPBackwardContext, following) -> JaxGDPInputGradients:
        ctx = backward_context
        outgoing_grad = _fold_neighbours(following, compose_backward, ctx.is_packed)
        outgoing_grad = match_vma(outgoing_grad, ctx.incoming)
        # S_out = M S_in + E, so dE = dS_out and dM = dS_out S_in^T.
        transition_grad = _einsum("bhkv,bhlv->bhkl", outgoing_grad, ctx.incoming)
        grads = ctx.prepare_vjp((ctx.terms_grad, outgoing_grad, transition_grad))
        return JaxGDPInputGradients(*(grad.astype(dtype) for grad, dtype in zip(grads, ctx.input_dtypes)))
