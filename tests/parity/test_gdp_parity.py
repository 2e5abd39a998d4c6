"""Cross-framework parity: torch_api (gloo ranks) and jax_api (host devices) chunkwise-CP GDP.

The same float32 inputs go through ``torch_api.gdp_chunkwise_context_parallel`` on local shards
(each rank builds its own ``PackedSequenceCPMetadata``) and through
``jax_api.gdp_chunkwise_context_parallel`` on global arrays (metadata derived on device from the
replicated ids); the output and all five gradients must agree within twice the float32 rounding
bound of GDP over the sequence (tests/tolerance.py). Each world
size runs all of its cases in one pool task; the JAX programs are the ones test_gdp_cp compiles
(same shapes and configs), so running both files shares their compilation.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.cp_linear.gdp_cases import random_gdp_inputs, seq_idx_from_lengths
from tests.jax_api.test_gdp_cp import HEADS, KEY_DIM, TOKENS, VALUE_DIM, cp_value_and_grad
from tests.tolerance import assert_close, gdp_length, tolerance

pytestmark = pytest.mark.multirank
JAX_CHUNK = 8  # the JAX side runs several chunks per shard; torch runs its default chunk of 64

# (name, lengths or None for batch rows, batch, num_householder, use_qk_l2norm)
CASES = [
    ("document-spans-every-rank", [1, 22, 1], 1, 2, False),
    ("documents-end-on-rank-boundaries", [8, 4, 4, 8], 1, 2, False),
    ("rank-holds-many-one-token-documents", [3, 1, 1, 2, 1, 1, 1, 14], 1, 2, False),
    ("three-householder-steps-with-qk-l2norm", [1, 1, 5, 1, 15, 1], 1, 3, True),
    ("batch-rows-each-one-sequence", None, 2, 2, False),
]


def case_inputs(seed, lengths, batch, num_householder):
    rng = np.random.default_rng(seed)
    inputs = random_gdp_inputs(rng, batch=batch, tokens=TOKENS, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM,
                               num_householder=num_householder)
    output_grad = rng.normal(size=(batch, TOKENS, HEADS, VALUE_DIM))
    return [x.astype(np.float32) for x in (*inputs, output_grad)]


def torch_cases(rank, world_size, cases):
    """On every rank: each case's local output and local dq, dk, dv, dg, dbeta as numpy."""
    import torch
    import torch.distributed as dist

    from cp_linear import build_packed_sequence_cp_metadata
    from torch_api import gdp_chunkwise_context_parallel

    local = TOKENS // world_size
    results = []
    for lengths, num_householder, use_qk_l2norm, arrays in cases:
        n = num_householder
        tokens, steps = slice(rank * local, (rank + 1) * local), slice(rank * local * n, (rank + 1) * local * n)
        q, k, v, g, beta, output_grad = (torch.from_numpy(x[:, part].copy()) for x, part in zip(
            arrays, (tokens, steps, steps, tokens, steps, tokens)))
        leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
        metadata = None
        if lengths is not None:
            metadata = build_packed_sequence_cp_metadata(seq_idx_from_lengths(lengths), rank, world_size)
        out = gdp_chunkwise_context_parallel(*leaves, cp_group=dist.group.WORLD, metadata=metadata,
                                             num_householder=n, use_qk_l2norm_in_kernel=use_qk_l2norm)
        out.backward(output_grad)
        results.append([out.detach().numpy()] + [t.grad.numpy() for t in leaves])
    return results


def jax_case(world, lengths, num_householder, use_qk_l2norm, arrays):
    packed = lengths is not None
    seq_idx = seq_idx_from_lengths(lengths) if packed else np.zeros((1, TOKENS))
    fn = cp_value_and_grad(world, num_householder, use_qk_l2norm, packed, JAX_CHUNK)
    (_, out), grads = fn(*(jnp.asarray(x) for x in arrays[:5]), jnp.asarray(seq_idx, jnp.int32),
                         jnp.asarray(arrays[5]))
    return [np.asarray(out)] + [np.asarray(grad) for grad in grads]


@pytest.mark.parametrize("world", [2, 4])
def test_torch_and_jax_context_parallel_gdp_agree(gloo_pools, world):
    cases = [(lengths, n, l2, case_inputs(world * 100 + index, lengths, batch, n))
             for index, (_, lengths, batch, n, l2) in enumerate(CASES)]
    per_rank = gloo_pools(world).run(torch_cases, cases)
    token_axis_parts = (1, 1, 1, 1, 1, 1)  # output and every gradient are split along axis 1
    for index, (name, lengths, _, n, l2) in enumerate(CASES):
        torch_side = [np.concatenate([per_rank[rank][index][part] for rank in range(world)], axis=axis)
                      for part, axis in enumerate(token_axis_parts)]
        jax_side = jax_case(world, lengths, n, l2, cases[index][3])
        tol = tolerance(gdp_length(TOKENS, n, KEY_DIM), compared_with="rounded")
        for label, from_torch, from_jax in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), torch_side, jax_side):
            assert from_torch.shape == from_jax.shape, (name, label)
            assert_close(f"{name} {label}", from_torch, from_jax, tol)
