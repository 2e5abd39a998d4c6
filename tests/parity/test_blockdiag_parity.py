"""Cross-framework parity: torch_api (gloo ranks) and jax_api (host devices) block-diagonal attention.

The same float32 inputs go through ``torch_api.blockdiag_attention`` on local shards and through
``jax_api.blockdiag_attention`` on global arrays; outputs and dq, dk, dv must agree within twice
the float32 rounding bound of attention over T tokens of dimension D (tests/tolerance.py) in
every mode. Each world size runs all of its cases in one pool task.
"""

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from cp_linear import build_blockdiag_plan
from tests.tolerance import assert_close, attention_length, tolerance

pytestmark = pytest.mark.multirank


def doc_ids_from_runs(runs):
    return np.concatenate([np.full(length, doc, np.int64) for doc, length in runs])


# world size -> [(name, runs)], one head layout per world; T = world * 13, D = 20. The cases of a
# world share static exchange sizes where possible, so they share compiled JAX programs.
CASES = {
    2: [
        ("straddle-and-interior-padding", [(1, 2), (0, 1), (2, 18), (0, 2), (3, 3)]),
        ("one-document-over-both-ranks", [(5, 26)]),
    ],
    4: [
        ("all-padding-rank-and-boundary-ends", [(1, 13), (0, 13), (2, 20), (3, 6)]),
        ("document-spans-three-ranks", [(0, 2), (4, 33), (2, 12), (0, 5)]),
    ],
}
HEADS = {2: (4, 2), 4: (2, 1)}  # GQA 4:2 and 2:1
LOCAL_LEN, HEAD_DIM, BATCH = 13, 20, 2


def parity_inputs(world, heads, seed):
    q_heads, kv_heads = heads
    tokens = world * LOCAL_LEN
    rng = np.random.default_rng(seed)
    shapes = [(BATCH, tokens, q_heads, HEAD_DIM), (BATCH, tokens, kv_heads, HEAD_DIM),
              (BATCH, tokens, kv_heads, HEAD_DIM), (BATCH, tokens, q_heads, HEAD_DIM)]
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def modes_for(doc_ids, world):
    return ["auto", "allgather", "a2a"] + (["halo"] if build_blockdiag_plan(doc_ids, world).use_halo else [])


def torch_cases(rank, world_size, cases):
    """On every rank: each case in each mode; local output and dq, dk, dv as numpy."""
    import torch
    import torch.distributed as dist

    from torch_api import blockdiag_attention

    local = slice(rank * LOCAL_LEN, (rank + 1) * LOCAL_LEN)
    results = []
    for doc_ids, inputs, modes in cases:
        q, k, v, cotangent = (torch.from_numpy(x[:, local].copy()) for x in inputs)
        for mode in modes:
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = blockdiag_attention(*leaves, torch.from_numpy(doc_ids), cp_group=dist.group.WORLD, mode=mode)
            out.backward(cotangent)
            results.append([out.detach().numpy()] + [t.grad.numpy() for t in leaves])
    return results


def jax_case(world, mode, doc_ids, inputs):
    from jax_api.attention.blockdiag import plan_blockdiag_exchange

    plan = plan_blockdiag_exchange(doc_ids, world, mode=mode, platform="cpu")
    (_, out), grads = jax_jit_value_and_grad(world)(*inputs[:3], plan, inputs[3])
    return [np.asarray(out)] + [np.asarray(g) for g in grads]


@lru_cache(maxsize=None)
def jax_jit_value_and_grad(world):
    from jax_api import blockdiag_attention

    mesh = Mesh(np.array(jax.devices()[:world]), ("cp",))

    def loss(q, k, v, plan, cotangent):
        out = blockdiag_attention(q, k, v, plan, mesh=mesh)
        return jnp.sum(out * cotangent), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("world", sorted(CASES))
def test_torch_and_jax_agree_in_every_mode(gloo_pools, world):
    prepared = []
    for seed, (_, runs) in enumerate(CASES[world]):
        doc_ids = doc_ids_from_runs(runs)
        prepared.append((doc_ids, parity_inputs(world, HEADS[world], seed), modes_for(doc_ids, world)))
    per_rank = gloo_pools(world).run(torch_cases, prepared)
    tol = tolerance(attention_length(world * LOCAL_LEN, HEAD_DIM), compared_with="rounded")
    index = 0
    for (name, _), (doc_ids, inputs, modes) in zip(CASES[world], prepared):
        for mode in modes:
            torch_result = [np.concatenate([ranks[index][i] for ranks in per_rank], axis=1) for i in range(4)]
            index += 1
            jax_result = jax_case(world, mode, doc_ids, inputs)
            for what, got, want in zip(("out", "dq", "dk", "dv"), jax_result, torch_result):
                assert got.shape == want.shape, f"{name} mode={mode} {what}"
                assert_close(f"{name} mode={mode} {what}", want, got, tol)
