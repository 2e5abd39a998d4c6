"""The range flags of containment (``any_in_ranges``, ``gdp_token_poison``) equal a brute-force numpy
reference, in torch, numpy and jax (also under ``jax.jit``), for token counts below, at and past the
block of the two-level prefix count (``_prefix_counts``), with sparse flags so that a flag counts in a
block after its own only through the block offsets."""

import numpy as np
import pytest
import torch

from cp_linear.validation import _SCAN_BLOCK, _prefix_counts, any_in_ranges, gdp_token_poison

BATCH, HEADS = 2, 3
TOKENS = [0, 1, 7, _SCAN_BLOCK - 1, _SCAN_BLOCK, _SCAN_BLOCK + 1, 2 * _SCAN_BLOCK - 1, 1000]
NAMESPACES = ["torch", "numpy", "jax", "jax-jit"]


def _random_case(tokens: int, seed: int):
    """flags bool [B, T, H] (sparse), boundaries cu_seqlens int [N + 1] with some empty sequences, and each
    token's sequence start int [T]."""
    rng = np.random.default_rng(seed)
    flags = rng.random((BATCH, tokens, HEADS)) < 0.01
    cuts = np.sort(rng.integers(0, tokens + 1, size=rng.integers(0, 6)))
    cu_seqlens = np.concatenate([[0], cuts, [tokens]]).astype(np.int32)
    start = cu_seqlens[np.searchsorted(cu_seqlens, np.arange(tokens), side="right") - 1].astype(np.int32)
    return rng, flags, cu_seqlens, start


def _any_in_ranges_reference(flags, start, stop):
    out = np.zeros((flags.shape[0], len(start), flags.shape[2]), dtype=bool)
    for m, (first, end) in enumerate(zip(start, stop)):
        out[:, m] = flags[:, first:end].any(axis=1)
    return out


def _token_poison_reference(state_bad, read_bad, start, incoming_bad):
    """Token t is poisoned by a bad read of its own, a bad state input of a token of its sequence up to t,
    or a bad incoming state when its sequence starts at 0."""
    poisoned = read_bad.copy()
    for t in range(state_bad.shape[1]):
        poisoned[:, t] |= state_bad[:, start[t]:t + 1].any(axis=1)
        if start[t] == 0 and incoming_bad is not None:
            poisoned[:, t] |= incoming_bad
    return poisoned


def _convert(namespace: str):
    if namespace == "torch":
        return torch.from_numpy
    if namespace == "numpy":
        return np.asarray
    jnp = pytest.importorskip("jax.numpy")
    return jnp.asarray


def _maybe_jit(namespace: str, function):
    if namespace != "jax-jit":
        return function
    import jax

    return jax.jit(function)


@pytest.mark.parametrize("namespace", ["torch", "numpy", "jax"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_prefix_counts_equal_the_one_level_sum(namespace, tokens):
    _, flags, _, _ = _random_case(tokens, seed=tokens)
    counts = _prefix_counts(_convert(namespace)(np.moveaxis(flags, 1, -1).copy()))
    expected = np.concatenate([np.zeros((BATCH, HEADS, 1), int), np.cumsum(np.moveaxis(flags, 1, -1), -1)], -1)
    assert str(counts.dtype).endswith("int32")
    np.testing.assert_array_equal(np.asarray(counts), expected)


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_any_in_ranges_equals_brute_force(namespace, tokens):
    convert = _convert(namespace)
    run = _maybe_jit(namespace, any_in_ranges)
    for seed in range(3):
        _, flags, cu_seqlens, start = _random_case(tokens, seed=1000 * seed + tokens)
        per_sequence = run(convert(flags), convert(cu_seqlens[:-1]), convert(cu_seqlens[1:]))
        np.testing.assert_array_equal(np.asarray(per_sequence),
                                      _any_in_ranges_reference(flags, cu_seqlens[:-1], cu_seqlens[1:]))
        stop = np.arange(1, tokens + 1, dtype=np.int32)
        per_token = run(convert(flags), convert(start), convert(stop))
        np.testing.assert_array_equal(np.asarray(per_token), _any_in_ranges_reference(flags, start, stop))


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("rows", [False, True], ids=["varlen", "rows"])
@pytest.mark.parametrize("with_incoming", [False, True], ids=["no-incoming", "incoming"])
def test_gdp_token_poison_equals_brute_force(namespace, tokens, rows, with_incoming):
    convert = _convert(namespace)
    for seed in range(3):
        rng, state_bad, _, start = _random_case(tokens, seed=1000 * seed + tokens)
        read_bad = rng.random(state_bad.shape) < 0.01
        incoming_bad = rng.random((BATCH, HEADS)) < 0.5 if with_incoming else None
        if rows:  # every token's sequence starts at 0: the prefix branch (start None)
            start = np.zeros(tokens, dtype=np.int32)
        expected = _token_poison_reference(state_bad, read_bad, start, incoming_bad)

        def poison(state, read, start_or_none, incoming):
            return gdp_token_poison(state, read, None if rows else start_or_none, incoming)

        arrays = [convert(a) for a in (state_bad, read_bad, start)] + [None if incoming_bad is None
                                                                        else convert(incoming_bad)]
        np.testing.assert_array_equal(np.asarray(_maybe_jit(namespace, poison)(*arrays)), expected)
