"""Input rules shared by both frontends, and the array helpers that keep documents numerically apart.

Everything here is framework-neutral: limits and messages are plain Python, and the array helpers
run on numpy, torch or jax arrays alike through ``array_api_compat`` (like ``cp_linear.summary``).
docs/failure_modes.md says which op checks what, when, and at what cost.

Glossary
  static check   shapes, dtypes, limits and flags: host values only, free, also under ``jax.jit``
  value check    a property of the numbers (NaN/Inf, g > 0, beta outside [0, 2]): one reduction per
                 input on the device and one host read per call (the frontends fold that read into
                 the cross-rank agreement under CP); skipped with ``check_inputs=False``
  isolation      without value checks a non-finite input is *contained* instead: inputs are
                 sanitised (non-finite -> 0) before any matmul, and the outputs that really depend on
                 a non-finite input are set to NaN by selection afterwards, so NaN/Inf never reaches
                 another document, another sequence, padding, or an earlier token::

        doc ids   1 1 1 1 2 2 2 0 0 3 3 3          NaN in v at token 5 (document 2)
        output    . . . . . N N 0 0 . . .          N = NaN, 0 = padding (exactly zero), . = exact
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Sequence

import array_api_compat

from cp_linear.chunking import bounds_after_first
from cp_linear.gdp import MAX_KEY_DIM, MAX_VALUE_DIM  # the largest key / value head dims both frontends accept

Array = Any  # numpy.ndarray | torch.Tensor | jax.Array

BETA_MAX = 2.0  # beta in [0, 2]: sigmoid, or 2 sigmoid with allow_neg_eigval

NONFINITE = "non-finite values (NaN or Inf)"


# --------------------------------------------------------------------------- static checks


def gdp_dims_error(q_shape: Sequence[int], v_shape: Sequence[int]) -> str | None:
    """Empty or unsupported sizes of a GDP call (after the shape check); None when fine."""
    batch, tokens, heads, key_dim = (int(d) for d in q_shape)
    value_dim = int(v_shape[-1])
    if 0 in (batch, tokens, heads, key_dim, value_dim):
        return (f"empty inputs are not supported: B, T, H, K and V must all be ≥ 1; received "
                f"q {tuple(q_shape)}, v {tuple(v_shape)}")
    if key_dim > MAX_KEY_DIM:
        return f"K = {key_dim} exceeds the supported maximum K = {MAX_KEY_DIM}"
    if value_dim > MAX_VALUE_DIM:
        return f"V = {value_dim} exceeds the supported maximum V = {MAX_VALUE_DIM}"
    return None


def attention_dims_error(q_shape: Sequence[int], k_shape: Sequence[int]) -> str | None:
    """Empty attention inputs; None when fine."""
    if 0 in tuple(q_shape) or 0 in tuple(k_shape):
        return f"empty inputs are not supported; received q {tuple(q_shape)}, k/v {tuple(k_shape)}"
    return None


# --------------------------------------------------------------------------- value checks

# Each value check is one boolean per call; its message names the input. The frontends compute the
# booleans on the device, in this order, and read them in one host transfer.
GDP_VALUE_CHECKS = (
    ("q", NONFINITE + " in q"),
    ("k", NONFINITE + " in k"),
    ("v", NONFINITE + " in v"),
    ("g", NONFINITE + " in g"),
    ("beta", NONFINITE + " in beta"),
    ("g_positive", "g > 0 (g is a log decay and must be ≤ 0; a growing state overflows)"),
    ("beta_range", f"beta outside [0, {BETA_MAX:g}]"),
)


def nonfinite_message(names: Sequence[str]) -> str:
    return f"{NONFINITE} in {', '.join(names)}"


def describe_failed(checks: Sequence[tuple[str, str]], failed: Sequence[bool]) -> str | None:
    """One message listing the checks whose flag is set, or None when none is."""
    nonfinite = [name for (name, message), bad in zip(checks, failed) if bad and message.startswith(NONFINITE)]
    others = [message for (_, message), bad in zip(checks, failed) if bad and not message.startswith(NONFINITE)]
    parts = ([nonfinite_message(nonfinite)] if nonfinite else []) + others
    return "; ".join(parts) if parts else None


def value_bounds(x, extrema=None):
    """(min, max) of ``x`` as 0-d arrays, or None when ``x`` is empty. NaN propagates through min and
    max (torch, JAX, numpy), so both bounds are finite exactly when every value is: a check reads
    each input once and writes nothing, where ``all(isfinite(x))`` also writes and rereads a mask.
    ``extrema``: a one-pass (min, max) of the frontend (torch.aminmax); default two reductions."""
    if math.prod(x.shape) == 0:
        return None
    if extrema is not None:
        return extrema(x)
    xp = array_api_compat.array_namespace(x)
    return xp.min(x), xp.max(x)


def nonfinite_flag(x, bounds):
    """0-d bool: ``x`` holds NaN/Inf, from its ``value_bounds`` (None: empty, nothing to flag)."""
    xp = array_api_compat.array_namespace(x)
    if bounds is None:
        return ~xp.all(xp.isfinite(x))
    low, high = bounds
    return ~(xp.isfinite(low) & xp.isfinite(high))


def gdp_value_flags(q, k, v, g, beta, *, extrema=None) -> list:
    """The ``GDP_VALUE_CHECKS`` as 0-d boolean arrays (True = failed), computed where the inputs live
    from each input's min and max (``value_bounds``: one read per input with ``extrema``).

    No host read here: the caller stacks them and reads them once (or ships them in an agreement).
    """
    xp = array_api_compat.array_namespace(q)
    bounds = [value_bounds(x, extrema) for x in (q, k, v, g, beta)]
    flags = [nonfinite_flag(x, b) for x, b in zip((q, k, v, g, beta), bounds)]
    g_bounds, beta_bounds = bounds[3], bounds[4]
    flags.append(xp.any(g > 0) if g_bounds is None else g_bounds[1] > 0)
    flags.append(xp.any((beta < 0) | (beta > BETA_MAX)) if beta_bounds is None
                 else (beta_bounds[0] < 0) | (beta_bounds[1] > BETA_MAX))
    return flags


def stacked_bounds(arrays: Sequence, extrema=None):
    """(lows, highs): the ``value_bounds`` of every array stacked into two [n] arrays (their dtypes
    promoted to a common one, which keeps every value: bf16 / fp16 -> float32), or None when an array
    is empty. One stack per side instead of one flag per array: few operations for a frontend that
    dispatches each from the host."""
    bounds = [value_bounds(x, extrema) for x in arrays]
    if any(b is None for b in bounds):
        return None
    xp = array_api_compat.array_namespace(*arrays)
    return xp.stack([low for low, _ in bounds]), xp.stack([high for _, high in bounds])


def nonfinite_from_bounds(lows, highs):
    """bool [n]: the arrays whose ``stacked_bounds`` hold NaN/Inf (``nonfinite_flag`` of each)."""
    xp = array_api_compat.array_namespace(lows)
    return ~(xp.isfinite(lows) & xp.isfinite(highs))


def gdp_value_flag_array(q, k, v, g, beta, *, extrema=None):
    """The ``GDP_VALUE_CHECKS`` as one bool [7] array, the same flags as ``gdp_value_flags`` stacked,
    read off the five inputs' ``stacked_bounds`` (torch: 19 operations instead of 45)."""
    bounds = stacked_bounds((q, k, v, g, beta), extrema)
    xp = array_api_compat.array_namespace(q)
    if bounds is None:  # an empty input: the checks one by one
        return xp.stack(gdp_value_flags(q, k, v, g, beta, extrema=extrema))
    lows, highs = bounds
    g_positive = highs[3:4] > 0
    beta_outside = (lows[4:5] < 0) | (highs[4:5] > BETA_MAX)
    return xp.concat([nonfinite_from_bounds(lows, highs), g_positive, beta_outside])


# --------------------------------------------------------------------------- agreement signatures


def digest(values: Sequence[Any]) -> int:
    """A non-negative 62-bit int that changes when ``values`` (ints, floats, strings, tuples) change.

    For cross-rank agreement headers: long descriptions travel as one number.
    """
    raw = repr(tuple(values)).encode()
    return ((zlib.crc32(raw) << 30) ^ zlib.adler32(raw)) & ((1 << 62) - 1)


# --------------------------------------------------------------------------- isolation helpers


def sanitize(x: Array) -> Array:
    """``x`` with every NaN/Inf replaced by 0, by selection (so no NaN * 0 anywhere downstream)."""
    if array_api_compat.is_torch_array(x):  # one pass (isfinite + where: two, and a bool tensor as large as x)
        import torch

        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # its gradient is zero where it replaced
    xp = array_api_compat.array_namespace(x)
    return xp.where(xp.isfinite(x), x, xp.zeros_like(x))


def nonfinite_rows(x: Array, feature_axes: int) -> Array:
    """bool ``x.shape[:-feature_axes]``: True where a row holds any NaN/Inf (0 feature axes: per entry)."""
    xp = array_api_compat.array_namespace(x)
    if feature_axes and array_api_compat.is_torch_array(x) and all(x.shape[-feature_axes:]):
        # one reduction pass in torch (NaN propagates through min and max: finite bounds <=> all finite)
        import torch

        low, high = torch.aminmax(x.flatten(-feature_axes) if feature_axes > 1 else x, dim=-1)
        return (low * 0 + high * 0).isnan()  # NaN exactly where low or high is NaN or +-Inf (see below)
    if array_api_compat.is_torch_array(x) and x.is_floating_point():
        bad = (x * 0).isnan()  # two ops: ~torch.isfinite dispatches five (abs, ne, eq, mul, not), each a launch
        return bad if feature_axes == 0 else bad.any(dim=tuple(range(-feature_axes, 0)))
    bad = ~xp.isfinite(x)
    if feature_axes == 0:
        return bad
    return xp.any(bad, axis=tuple(range(-feature_axes, 0)))


_SCAN_BLOCK = 256  # tokens per block of ``blocked_prefix_counts``'s first-level scan
# torch tensors take ``torch_api._prefix_counts``'s custom op (registered on import of the torch frontend): it runs
# these scans eagerly inside compiled graphs, where Inductor's Triton scan codegen failed on them (torch 2.11)
_torch_prefix_counts = None


def register_torch_prefix_counts(op) -> None:
    """Route ``_prefix_counts`` of torch tensors through ``op`` (same contract as ``blocked_prefix_counts``)."""
    global _torch_prefix_counts
    _torch_prefix_counts = op


def _prefix_counts(flags: Array) -> Array:
    """``blocked_prefix_counts``, through the registered custom op for torch tensors."""
    if _torch_prefix_counts is not None and array_api_compat.is_torch_array(flags):
        return _torch_prefix_counts(flags)
    return blocked_prefix_counts(flags)


def blocked_prefix_counts(flags: Array) -> Array:
    """int32 [..., T + 1]: ``counts[..., t]`` = the number of set ``flags[..., :t]`` (bool, or int 0/1,
    [..., T]), so ``counts[..., 0] = 0``: the inclusive-initial prefix sum along the last axis, in two levels.

    The scan runs along the last axis: torch scans an outer axis with one thread per column (1.5 ms for
    [1, 8192, 16] on an H200, against microseconds along the last one). And in blocks: torch scans the last
    axis with about one thread block per row, so [1, 16, 131072] ran as 16 nearly serial rows (0.48 ms on an
    H100); as [..., T / 256, 256] the rows scan in parallel, then the short axis of block totals. Integer sums,
    so the counts are exactly the one-level ones; int32, as a count is at most T."""
    xp = array_api_compat.array_namespace(flags)
    *lead, tokens = flags.shape
    length = tokens + 1  # a zero in front makes the inclusive scan the inclusive-initial one
    if length <= _SCAN_BLOCK:
        front = xp.zeros((*lead, 1), dtype=flags.dtype, **_placed_like(flags))
        return xp.cumulative_sum(xp.concat([front, flags], axis=-1), axis=-1, dtype=xp.int32)
    blocks = -(-length // _SCAN_BLOCK)
    front, back = (xp.zeros((*lead, n), dtype=flags.dtype, **_placed_like(flags))
                   for n in (1, blocks * _SCAN_BLOCK - length))  # back: zeros filling the last block
    padded = xp.reshape(xp.concat([front, flags, back], axis=-1), (*lead, blocks, _SCAN_BLOCK))
    within = xp.cumulative_sum(padded, axis=-1, dtype=xp.int32)  # [..., blocks, block]: many short rows
    totals = within[..., -1]
    before = xp.cumulative_sum(totals, axis=-1, dtype=xp.int32) - totals  # exclusive: the blocks in front
    return xp.reshape(within + before[..., None], (*lead, blocks * _SCAN_BLOCK))[..., :length]


def any_in_ranges(flags: Array, start: Array, stop: Array) -> Array:
    """``out[:, m, ...] = any(flags[:, start[m]:stop[m], ...])`` along axis 1, for int index arrays
    ``start``, ``stop`` [M] (``start <= stop``): two prefix sums and two gathers, no [M, N] mask."""
    xp = array_api_compat.array_namespace(flags)
    counts = _prefix_counts(xp.moveaxis(flags, 1, -1))  # the scan runs along the last axis (``_prefix_counts``)
    return xp.moveaxis((xp.take(counts, stop, axis=-1) - xp.take(counts, start, axis=-1)) > 0, -1, 1)


def poison(x: Array, mask: Array) -> Array:
    """``x`` with NaN where ``mask`` (broadcast against x) is True, by selection."""
    if array_api_compat.is_torch_array(x):  # one pass: a NaN scalar, no NaN tensor as large as x to fill and read
        import torch

        # the result takes the memory order of the condition: a permuted mask ([B, T, H] from a [B, H, T] scan,
        # ``gdp_token_poison``) made the GDP output, and so its gradient, [B, H, T, V] in memory, which the
        # backward then copied back (8 MB at 32k tokens); a contiguous mask costs a copy of a few bool rows
        return torch.where(mask.contiguous(), float("nan"), x)
    xp = array_api_compat.array_namespace(x)
    return xp.where(mask, xp.full_like(x, float("nan")), x)


def _placed_like(x) -> dict:
    """``device=`` for new arrays beside a torch tensor; jax and numpy place them themselves (a jax
    tracer has no device to ask)."""
    return {"device": x.device} if array_api_compat.is_torch_array(x) else {}


# --------------------------------------------------------------------------- GDP containment
# Per token t and head h, an output is poisoned when q[t] is non-finite, or when any k, v, beta step
# or g of a token s <= t of the same sequence is (``torch_api.gdp.isolation`` draws it). Bool arrays
# [B, T, H]; ``start`` int [T] is the index of the first token of each token's sequence.


def gdp_bad_tokens(q, k, v, g, beta, num_householder: int) -> tuple[Array, Array]:
    """(state_bad, read_bad), bool [B, T, H] each: a non-finite input that enters the state at token t
    (k, v, beta of its steps, or g[t]), and a non-finite q[t] (read once, by output t only)."""
    xp = array_api_compat.array_namespace(q)
    batch, tokens, heads = g.shape
    steps = nonfinite_rows(k, 1) | nonfinite_rows(v, 1) | nonfinite_rows(beta, 0)  # [B, T*n_h, H]
    state_bad = xp.any(xp.reshape(steps, (batch, tokens, num_householder, heads)), axis=2) | nonfinite_rows(g, 0)
    return state_bad, nonfinite_rows(q, 1)


def zero_flagged_rows(x: Array, flags: Array, rows_per_flag: int) -> Array:
    """``x`` [..., rows, H, D] with the rows of every flagged (token, head) zero: ``flags`` [..., tokens, H]
    (bool or uint8, nonzero: flagged), a token owning ``rows_per_flag`` consecutive rows (its n_h steps of
    k and v; 1 for q)."""
    xp = array_api_compat.array_namespace(x)
    mask = xp.repeat(flags != 0, rows_per_flag, axis=flags.ndim - 2)[..., None]
    return xp.where(mask, xp.zeros_like(x), x)


def zero_flagged_inputs(q, k, v, g, beta, state_bad: Array, read_bad: Array, num_householder: int) -> tuple:
    """(q, k, v, g, beta) as a contained chunk kernel computes with them (``GDPInputs.token_flags``): the k
    and v rows of every step of a ``state_bad`` token and the q row of a ``read_bad`` token zero (flags:
    bool or uint8 [B, T, H]), every non-finite g and beta 0. Its finite outputs (the ones not poisoned)
    are those of the sanitised inputs: a zeroed row differs from its sanitised one only where the
    outputs it reaches are poisoned. For a backend or a pass that takes no token flags."""
    return (zero_flagged_rows(q, read_bad, 1), zero_flagged_rows(k, state_bad, num_householder),
            zero_flagged_rows(v, state_bad, num_householder), sanitize(g), sanitize(beta))


def poison_read_bad(output, read_bad: Array):
    """``output`` (o [B, T, H, V], or (o, final states)) with the outputs of read_bad tokens (flags bool or
    uint8 [B, T, H]) NaN: the contained output scan's store, for a path that takes no token flags."""
    o, final = output if isinstance(output, tuple) else (output, None)
    o = poison(o, (read_bad != 0)[..., None])
    return o if final is None else (o, final)


def zero_read_bad_grad(output_grad, read_bad: Array):
    """``output_grad`` (dO [B, T, H, V] or None, or (dO, final-state gradient)) with the dO rows of read_bad
    tokens zero: a poisoned output passes no gradient (the backward kernels zero those rows as they load)."""
    do, final_grad = output_grad if isinstance(output_grad, tuple) else (output_grad, None)
    if do is not None:
        do = zero_flagged_rows(do, read_bad, 1)
    return (do, final_grad) if isinstance(output_grad, tuple) else do


def without_token_flags(inputs):
    """``GDPInputs`` for a path that takes no token flags (a backend's fallback, a jnp / torch backward): the
    flagged rows zero (``zero_flagged_inputs``), as the contained chunk kernels see them; unflagged inputs as
    they are."""
    if inputs.token_flags is None:
        return inputs
    q, k, v, g, beta = zero_flagged_inputs(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, *inputs.token_flags,
                                           inputs.num_householder)
    return dataclasses.replace(inputs, q=q, k=k, v=v, g=g, beta=beta, token_flags=None)


def sequence_start_index(cu_seqlens: Array, tokens: int) -> Array:
    """int [T]: index of the first token of each token's sequence, from boundaries int [N + 1]."""
    xp = array_api_compat.array_namespace(cu_seqlens)
    position = xp.arange(tokens, dtype=cu_seqlens.dtype, **_placed_like(cu_seqlens))
    return xp.take(cu_seqlens, bounds_after_first(cu_seqlens, position))


def gdp_token_poison(state_bad: Array, read_bad: Array, start: Array | None, incoming_bad: Array | None = None
                     ) -> Array:
    """bool [B, T, H]: outputs that depend on a non-finite input. ``incoming_bad`` bool [B or 1, H]: the
    state entering the shard is poisoned, which reaches the tokens of its first sequence (start 0).
    ``start`` None: every token's sequence starts at 0 (rows), so the ranges are prefixes: one prefix
    sum, no gathers (the same values as ``start`` all zero)."""
    xp = array_api_compat.array_namespace(state_bad)
    # read_bad first: torch lays a result out like its first operand whose strides decide, so the mask comes
    # out in [B, T, H] order (the scans' results are [B, H, T] in memory), and ``poison`` needs no copy of it
    if start is None:
        counts = _prefix_counts(xp.moveaxis(state_bad, 1, -1))  # along the last axis (``_prefix_counts``)
        poisoned = read_bad | xp.moveaxis(counts[..., 1:] > 0, -1, 1)
        return poisoned if incoming_bad is None else poisoned | incoming_bad[:, None, :]
    stop = xp.arange(1, state_bad.shape[1] + 1, dtype=start.dtype, **_placed_like(start))
    poisoned = read_bad | any_in_ranges(state_bad, start, stop)
    if incoming_bad is not None:
        poisoned = poisoned | (incoming_bad[:, None, :] & (start == 0)[None, :, None])
    return poisoned


def gdp_trailing_bad(state_bad: Array, start: Array) -> Array:
    """bool [B, H]: the trailing sequence fragment (tokens from the last start) holds a bad state input."""
    xp = array_api_compat.array_namespace(state_bad)
    in_last = (start == start[-1])[None, :, None]  # a mask, so no host read of start
    return xp.any(state_bad & in_last, axis=1)


def gdp_sequence_bad(state_bad: Array, cu_seqlens: Array | None) -> Array:
    """bool [N, H]: sequence n holds a non-finite state input (rows, cu_seqlens None: N = B)."""
    xp = array_api_compat.array_namespace(state_bad)
    if cu_seqlens is None:
        return xp.any(state_bad, axis=1)
    return any_in_ranges(state_bad, cu_seqlens[:-1], cu_seqlens[1:])[0]


__all__ = [
    "BETA_MAX", "GDP_VALUE_CHECKS", "MAX_KEY_DIM", "MAX_VALUE_DIM", "NONFINITE", "any_in_ranges",
    "attention_dims_error", "describe_failed", "digest", "gdp_bad_tokens", "gdp_dims_error", "gdp_sequence_bad",
    "gdp_token_poison", "gdp_trailing_bad", "gdp_value_flag_array", "gdp_value_flags", "nonfinite_flag",
    "nonfinite_from_bounds", "nonfinite_message", "nonfinite_rows", "poison", "poison_read_bad", "sanitize",
    "sequence_start_index", "stacked_bounds", "value_bounds", "without_token_flags", "zero_flagged_inputs",
    "zero_flagged_rows", "zero_read_bad_grad",
]
