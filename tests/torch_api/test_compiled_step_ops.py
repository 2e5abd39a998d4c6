"""The two places ``torch.compile`` of the decoder step failed on an H200 (issue 15), on CPU.

1. The GDP containment checks (``torch_api.gdp.isolation.bad_tokens``): fused with the gate's
   softplus, torch 2.11's Inductor crashed generating Triton for them. Under compile they are the
   opaque op ``cp_linear::gdp_bad_tokens``, so the graph Inductor gets holds the op, not the checks.
   (The crash itself is Triton-only: CPU Inductor compiles the fused checks.)
2. The flex block mask of ``cp_linear::blockdiag_attention_static``: ``create_block_mask``'s vmap
   failed inside the op on a compiled graph's first call (AOTAutograd's aliasing check calls the op
   from a Python dispatch mode, where functorch's keys are excluded). This reproduces on CPU.

Compiled with ``aot_eager`` (dynamo + AOTAutograd, the layer that failed in 2.), without inductor's
C++ compiler on the CI's two cores; ``torch._dynamo.reset()`` makes each case a graph's first call.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch.nn.attention.flex_attention import create_block_mask

from tests.tolerance import assert_close, attention_length, tolerance
from torch_api.attention.static import doc_causal_block_mask
from torch_api.gdp.chunk import TorchGDPBackend
from torch_api.gdp.isolation import bad_tokens
from torch_api.gdp.library import register_backend
from torch_api.gdp.ops import run_gated_delta_product
from cp_linear.validation import gdp_bad_tokens

# ----------------------------------------------------------------------------- 1. GDP containment checks

TOKENS, HEADS, KEY_DIM, VALUE_DIM, N_H = 19, 2, 8, 6, 2


def _gdp_problem(poisoned: bool, seed=0):
    """Layer-like inputs: x for the gate projection, A_log, dt_bias, and q, k, v, beta."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, TOKENS, HEADS, generator=generator)
    q = torch.randn(1, TOKENS, HEADS, KEY_DIM, generator=generator)
    k = F.normalize(torch.randn(1, TOKENS * N_H, HEADS, KEY_DIM, generator=generator), dim=-1)
    v = torch.randn(1, TOKENS * N_H, HEADS, VALUE_DIM, generator=generator)
    beta = torch.rand(1, TOKENS * N_H, HEADS, generator=generator)
    a_log = torch.rand(HEADS, generator=generator).log()
    dt_bias = torch.randn(HEADS, generator=generator)
    if poisoned:
        k[0, 2 * 5 + 1, 0, 3] = float("nan")  # token 5 (second step), head 0: the state from token 5 on
        x[0, 9, 1] = float("inf")  # g[9] = -inf on head 1: the state from token 9 on
        q[0, 3, 1, 0] = float("nan")  # output 3 of head 1 only
    return x, a_log, dt_bias, q, k, v, beta


def _gated_step(backend):
    def step(x, a_log, dt_bias, q, k, v, beta):
        g = -a_log.exp() * F.softplus(x + dt_bias)  # as torch_api.layers.gdp computes the gate
        return run_gated_delta_product(q, k, v, g, beta, backend=backend, scale=KEY_DIM ** -0.5,
                                       num_householder=N_H, cu_seqlens=torch.tensor([0, 7, TOKENS]),
                                       contain=True)
    return step


def _forward_graphs():
    """An aot_eager-like backend that keeps the forward graphs AOTAutograd hands to the compiler."""
    graphs = []

    def keep(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module

    return graphs, aot_autograd(fw_compiler=keep, bw_compiler=lambda gm, _: gm)


def test_the_bad_tokens_op_passes_opcheck_and_gives_the_eager_masks():
    x, a_log, dt_bias, q, k, v, beta = _gdp_problem(poisoned=True)
    g = -a_log.exp() * F.softplus(x + dt_bias)
    args = (q, k, v, g, beta, N_H)
    torch.library.opcheck(torch.ops.cp_linear.gdp_bad_tokens.default, args)
    for got, want in zip(torch.ops.cp_linear.gdp_bad_tokens(*args), gdp_bad_tokens(*args)):
        assert got.dtype == torch.bool and torch.equal(got, want)
    state_bad, read_bad = bad_tokens(*args)  # eager: the plain functions
    assert state_bad[0, 5, 0] and state_bad[0, 9, 1] and read_bad[0, 3, 1] and int(state_bad.sum()) == 2


@pytest.mark.parametrize("poisoned", [False, True], ids=["finite", "nan-poisoned"])
def test_compiled_contained_gdp_runs_the_checks_as_one_opaque_op_and_equals_eager(poisoned):
    torch._dynamo.reset()
    backend = TorchGDPBackend()
    register_backend(backend)
    step = _gated_step(backend)
    graphs, compiler = _forward_graphs()
    compiled = torch.compile(step, fullgraph=True, backend=compiler)
    problem = _gdp_problem(poisoned)
    results = {}
    for name, fn in {"eager": step, "compiled": compiled}.items():
        leaves = [x.clone().requires_grad_(x.is_floating_point() and name != "x") for x in problem]
        output, final = fn(*leaves)
        # gradients from the finite outputs (a poisoned output passes none)
        torch.where(output.isfinite(), output, 0).square().sum().backward()
        results[name] = [output, final, *(x.grad for x in leaves[1:])]

    # the graph Inductor would get calls the op once, and nothing in it reduces rows to find NaN/Inf
    (forward,) = graphs
    targets = [node.target for node in forward.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.cp_linear.gdp_bad_tokens.default) == 1, targets
    assert torch.ops.aten.aminmax.default not in targets, "row checks lowered into the graph"

    for index, (got, want) in enumerate(zip(results["compiled"], results["eager"])):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"compiled result {index}")
    output, final = results["eager"][:2]
    nan_tokens = output.isnan().any(-1)[0]  # [T, H]
    if poisoned:
        # sequence [0, 7): head 0 from token 5; sequence [7, 19): head 1 from token 9; token 3 of head 1
        expected = torch.zeros(TOKENS, HEADS, dtype=torch.bool)
        expected[5:7, 0] = True
        expected[9:, 1] = True
        expected[3, 1] = True
        assert torch.equal(nan_tokens, expected)
        assert torch.equal(final.isnan().flatten(2).any(-1), torch.tensor([[True, False], [False, True]]))
    else:
        assert not nan_tokens.any() and final.isfinite().all()


# ----------------------------------------------------------------------------- 2. flex block mask

# runs of (doc id, length); 0 = padding
PACKINGS = {
    "one-doc": [(1, 300)],
    "docs-padding-tail": [(1, 100), (2, 120), (3, 20), (0, 60)],
    "short-docs-padding-between": [(4, 3), (5, 130), (0, 7), (6, 1), (7, 129), (0, 30)],
    "block-aligned": [(1, 128), (2, 128), (0, 44)],
}
T = 300


def _doc_ids(runs) -> torch.Tensor:
    ids = np.repeat([doc for doc, _ in runs], [length for _, length in runs])
    assert ids.shape == (T,)
    return torch.from_numpy(ids).to(torch.int64)


@pytest.mark.parametrize("block", [16, 128], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("query_start, queries", [(0, T), (100, 100), (200, 100)], ids=lambda x: str(x))
@pytest.mark.parametrize("packing", PACKINGS)
def test_the_device_block_mask_equals_create_block_masks(packing, query_start, queries, block):
    ids = _doc_ids(PACKINGS[packing])

    def doc_causal(b, h, q_idx, kv_idx):
        query = q_idx + query_start
        return (ids[query] == ids[kv_idx]) & (kv_idx <= query) & (ids[query] > 0)

    want = create_block_mask(doc_causal, None, None, queries, T, device="cpu", BLOCK_SIZE=block)
    got = doc_causal_block_mask(ids, query_start, queries, block)
    assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                 "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    # the mask_mod inside the partial tiles: the rule, pair by pair
    q_idx, kv_idx = torch.arange(queries)[:, None], torch.arange(T)[None, :]
    assert torch.equal(got.mask_mod(0, 0, q_idx, kv_idx), doc_causal(0, 0, q_idx, kv_idx))


def _attention_inputs(seed, queries, q_heads=4, kv_heads=2, dim=16):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, queries, q_heads, dim, generator=generator)
    k, v = (torch.randn(1, T, kv_heads, dim, generator=generator) for _ in range(2))
    return q, k, v


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("contain", [False, True], ids=["plain", "contain-nan"])
@pytest.mark.parametrize("query_start, queries", [(0, T), (150, 150)], ids=lambda x: str(x))
@pytest.mark.parametrize("packing", PACKINGS)
def test_compiled_flex_static_attention_equals_eager_and_sdpa(packing, query_start, queries, contain):
    ids = _doc_ids(PACKINGS[packing]).to(torch.int32)
    q, k, v = _attention_inputs(1, queries)
    if contain:  # a NaN key in the first real document of the window: its later queries read it
        k[0, int(torch.nonzero(ids[query_start:] > 0)[0]) + query_start, 1, 2] = float("nan")

    def attend(q, k, v, ids, kernel):
        return torch.ops.cp_linear.blockdiag_attention_static(q, k, v, ids, query_start, "", 0.0, kernel, contain)

    torch._dynamo.reset()  # a fresh graph: its first call runs the op under AOTAutograd's aliasing check
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    flex = attend(q, k, v, ids, "flex")
    sdpa = attend(q, k, v, ids, "sdpa")
    torch.testing.assert_close(compiled(q, k, v, ids, "flex"), flex, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(flex.isnan(), sdpa.isnan())
    real = (ids[query_start:query_start + queries] > 0).view(1, -1, 1, 1)
    assert torch.all(torch.where(real, 0, flex) == 0)  # padding rows exactly 0
    finite = ~sdpa.isnan()
    assert_close("flex vs sdpa", sdpa[finite], flex[finite],
                 tolerance(attention_length(T, 16), compared_with="rounded"))
    if contain:
        assert flex.isnan().any() and finite.any()
