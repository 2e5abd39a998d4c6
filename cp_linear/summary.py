"""Affine state summaries passed between CP ranks, generic over numpy / torch / jax arrays.

Forward: the shard maps its incoming state to the outgoing state of its trailing sequence
fragment, ``S_out = M S_in + E`` (M [K, K], E [K, V]); M is ``dS_out/dS_in`` of the shard, so it
is zero when the trailing sequence starts inside the shard.
Backward: ``dS_in = M^T dS_out + gamma`` for the leading fragment (gamma [K, V]).

Packed forms are float32 ``[..., H, K, V + K]``: ``[E | M]`` forward, ``[gamma | M^T]`` backward.
Both compose with the same rule, so one ``combine`` serves both directions::

    combine(x, y) = y.M @ [x.E | x.M] + [y.E | 0]      # "x, then y"

Forward folds run over ranks in ascending order, backward folds in descending order.
The same code path runs for every array library through ``array_api_compat``; inside
``jax.jit`` it traces like any other jnp code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import array_api_compat

Array = Any  # numpy.ndarray | torch.Tensor | jax.Array


@dataclass(frozen=True)
class CPForwardUnpackedSummary:
    """transition M [..., H, K, K] and state_update E [..., H, K, V], float32."""

    transition: Array
    state_update: Array


@dataclass(frozen=True)
class CPForwardPackedSummary:
    """packed ``[E | M]`` [..., H, K, V + K], float32."""

    packed: Array


@dataclass(frozen=True)
class CPBackwardUnpackedSummary:
    """transition M [..., H, K, K] (stored untransposed) and local_state_grad gamma [..., H, K, V]."""

    transition: Array
    local_state_grad: Array


@dataclass(frozen=True)
class CPBackwardPackedSummary:
    """packed ``[gamma | M^T]`` [..., H, K, V + K], float32."""

    packed: Array


def _xp(x: Array):
    return array_api_compat.array_namespace(x)


def _is_floating_at_least_32(xp, x: Array) -> bool:
    return x.dtype in (xp.float32, xp.float64)


def validate_packed_summary(packed: Array, *, name: str = "summary", heads: int | None = None,
                            key_dim: int | None = None, value_dim: int | None = None) -> None:
    """Raise ValueError unless ``packed`` is a float32 ``[..., H, K, V + K]`` contiguous array."""
    xp = _xp(packed)
    if packed.dtype != xp.float32:
        raise ValueError(f"{name} must be float32; received {packed.dtype}")
    if packed.ndim < 3:
        raise ValueError(f"{name} must have shape [..., H, K, V + K]; received shape {tuple(packed.shape)}")
    h, k, vk = packed.shape[-3:]
    if vk <= k:
        raise ValueError(f"{name} last dim (V + K) = {vk} must exceed K = {k}")
    for label, want, got in (("H", heads, h), ("K", key_dim, k), ("V + K", None if value_dim is None or key_dim is None
                                                                 else value_dim + key_dim, vk)):
        if want is not None and want != got:
            raise ValueError(f"{name}: expected {label} = {want}, received {got} (shape {tuple(packed.shape)})")
    is_contiguous = getattr(packed, "is_contiguous", None)  # torch
    if is_contiguous is not None and not is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    flags = getattr(packed, "flags", None)  # numpy
    if flags is not None and not flags["C_CONTIGUOUS"]:
        raise ValueError(f"{name} must be C-contiguous")


def _key_dim(packed: Array) -> int:
    return packed.shape[-2]


def split_packed(packed: Array) -> tuple[Array, Array]:
    """``[A | B]`` -> (A [..., K, V], B [..., K, K]) as views where the library allows."""
    value_dim = packed.shape[-1] - _key_dim(packed)
    return packed[..., :value_dim], packed[..., value_dim:]


def pack(summary):
    """Unpacked dataclass -> packed dataclass (one concat on the last axis)."""
    if isinstance(summary, CPForwardUnpackedSummary):
        xp = _xp(summary.state_update)
        return CPForwardPackedSummary(xp.concat([summary.state_update, summary.transition], axis=-1))
    if isinstance(summary, CPBackwardUnpackedSummary):
        xp = _xp(summary.local_state_grad)
        transposed = xp.matrix_transpose(summary.transition)
        return CPBackwardPackedSummary(xp.concat([summary.local_state_grad, transposed], axis=-1))
    raise TypeError(f"pack expects an unpacked summary; received {type(summary).__name__}")


def unpack(summary):
    """Packed dataclass -> unpacked dataclass (views of the packed array; M^T transposed back)."""
    if isinstance(summary, CPForwardPackedSummary):
        update, transition = split_packed(summary.packed)
        return CPForwardUnpackedSummary(transition=transition, state_update=update)
    if isinstance(summary, CPBackwardPackedSummary):
        grad, transposed = split_packed(summary.packed)
        xp = _xp(summary.packed)
        return CPBackwardUnpackedSummary(transition=xp.matrix_transpose(transposed), local_state_grad=grad)
    raise TypeError(f"unpack expects a packed summary; received {type(summary).__name__}")


def as_packed_array(summary) -> Array:
    """Accept a packed array or any summary dataclass and return the packed array."""
    if isinstance(summary, (CPForwardUnpackedSummary, CPBackwardUnpackedSummary)):
        summary = pack(summary)
    if isinstance(summary, (CPForwardPackedSummary, CPBackwardPackedSummary)):
        return summary.packed
    return summary


def combine(earlier: Array, later: Array) -> Array:
    """Summary of "earlier, then later" on packed arrays ``[..., K, V + K]`` (broadcasts over ``...``).

    Associative, not commutative: ``combine(combine(a, b), c) == combine(a, combine(b, c))``.
    Works for forward ``[E | M]`` and backward ``[gamma | M^T]`` summaries alike.
    """
    xp = _xp(earlier)
    later_update, later_matrix = split_packed(later)
    applied = xp.matmul(later_matrix, earlier)
    value_dim = later_update.shape[-1]
    return xp.concat([applied[..., :value_dim] + later_update, applied[..., value_dim:]], axis=-1)


def apply_summary(packed: Array, state: Array) -> Array:
    """``M @ state + E`` for one summary: state [..., K, V] -> [..., K, V]."""
    xp = _xp(packed)
    update, matrix = split_packed(packed)
    return xp.matmul(matrix, state) + update


def _accumulation_dtype(xp, x: Array):
    return xp.float64 if x.dtype == xp.float64 else xp.float32


def compose_forward(stacked, state: Array | None = None) -> Array:
    """Fold stacked forward summaries ``[n, ..., H, K, V + K]`` in ascending order.

    Starts from ``state`` ([..., H, K, V], zeros when None) and returns the state after the last
    summary, float32 (float64 for float64 input). ``n`` may be 0.
    """
    stacked = as_packed_array(stacked)
    xp = _xp(stacked)
    dtype = _accumulation_dtype(xp, stacked)
    value_dim = stacked.shape[-1] - _key_dim(stacked)
    if state is None:
        acc = xp.zeros((*stacked.shape[1:-1], value_dim), dtype=dtype, device=array_api_compat.device(stacked))
    else:
        acc = xp.astype(state, dtype)
    for index in range(stacked.shape[0]):
        acc = apply_summary(xp.astype(stacked[index, ...], dtype), acc)
    return acc


def compose_backward(stacked) -> Array:
    """Fold stacked backward summaries ``[n, ..., H, K, V + K]`` (ranks ascending) in descending order.

    Returns the incoming state-gradient of the rank before the first entry, from a zero
    gradient after the last one; float32 (float64 for float64 input).
    """
    stacked = as_packed_array(stacked)
    xp = _xp(stacked)
    dtype = _accumulation_dtype(xp, stacked)
    value_dim = stacked.shape[-1] - _key_dim(stacked)
    acc = xp.zeros((*stacked.shape[1:-1], value_dim), dtype=dtype, device=array_api_compat.device(stacked))
    for index in range(stacked.shape[0] - 1, -1, -1):
        acc = apply_summary(xp.astype(stacked[index, ...], dtype), acc)
    return acc


def identity_summary(heads: int, key_dim: int, value_dim: int, *, like: Array) -> Array:
    """``[0 | I]`` [H, K, V + K]: the summary that changes nothing (neutral element of ``combine``)."""
    xp = _xp(like)
    eye = xp.eye(key_dim, dtype=xp.float32, device=array_api_compat.device(like))
    zeros = xp.zeros((heads, key_dim, value_dim), dtype=xp.float32, device=array_api_compat.device(like))
    return xp.concat([zeros, xp.broadcast_to(eye, (heads, key_dim, key_dim))], axis=-1)


def compose_forward_range(gathered: Array, start, stop) -> Array:
    """Fold ``gathered[start:stop]`` ascending from zero, where start/stop may be device scalars.

    ``gathered`` holds every rank's forward summary ``[cp, ..., K, V + K]``. Entries outside the
    range are replaced by the identity with a mask, so shapes stay static (usable under jax.jit
    and without a host sync in torch).
    """
    return _masked_fold(gathered, start, stop, descending=False)


def compose_backward_range(gathered: Array, start, stop) -> Array:
    """Fold ``gathered[start:stop]`` descending from zero; see ``compose_forward_range``."""
    return _masked_fold(gathered, start, stop, descending=True)


def fold_forward_range_summary(gathered: Array, start, stop) -> Array:
    """The summary ``[E | M]`` of ranks ``[start, stop)`` (ascending) of ``gathered`` [cp, ..., K, V + K]:
    the identity ``[0 | I]`` when the range is empty; start/stop may be device scalars (masked, static
    shapes). Unlike ``compose_forward_range`` it keeps M, so the fold can still be applied to an initial
    state: incoming = M S0 + E."""
    gathered = as_packed_array(gathered)
    xp = _xp(gathered)
    value_dim = gathered.shape[-1] - _key_dim(gathered)
    eye = xp.eye(_key_dim(gathered), dtype=gathered.dtype, device=array_api_compat.device(gathered))
    zeros = xp.zeros((*gathered.shape[1:-1], value_dim), dtype=gathered.dtype, device=array_api_compat.device(gathered))
    acc = xp.concat([zeros, xp.broadcast_to(eye, (*gathered.shape[1:-1], eye.shape[-1]))], axis=-1)
    for index in range(gathered.shape[0]):
        stepped = combine(acc, gathered[index, ...])
        inside = (index >= start) & (index < stop)
        if isinstance(inside, bool):
            acc = stepped if inside else acc
        else:
            acc = xp.where(inside, stepped, acc)
    return acc


def _masked_fold(gathered: Array, start, stop, *, descending: bool) -> Array:
    gathered = as_packed_array(gathered)
    xp = _xp(gathered)
    dtype = _accumulation_dtype(xp, gathered)
    update, matrix = split_packed(gathered)
    count = gathered.shape[0]
    acc = xp.zeros(update.shape[1:], dtype=dtype, device=array_api_compat.device(gathered))
    order = range(count - 1, -1, -1) if descending else range(count)
    for index in order:
        stepped = xp.matmul(xp.astype(matrix[index, ...], dtype), acc) + xp.astype(update[index, ...], dtype)
        inside = (index >= start) & (index < stop)
        if isinstance(inside, bool):  # host ints: no mask needed
            acc = stepped if inside else acc
        else:
            acc = xp.where(inside, stepped, acc)
    return acc


def inclusive_scan(stacked: Array) -> Array:
    """Inclusive prefix of ``combine`` over axis 0 in log2(n) rounds (Hillis-Steele).

    ``out[i] = combine(...combine(stacked[0], stacked[1])..., stacked[i])``. For JAX,
    ``jax.lax.associative_scan(combine, stacked)`` gives the same result.
    """
    xp = _xp(stacked)
    out = stacked
    count = stacked.shape[0]
    offset = 1
    while offset < count:
        shifted = combine(out[: count - offset, ...], out[offset:, ...])
        out = xp.concat([out[:offset, ...], shifted], axis=0)
        offset *= 2
    return out
