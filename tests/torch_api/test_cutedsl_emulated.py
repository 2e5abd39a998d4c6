"""The CuTeDSL backend's host path (work layout, launches, folds, CP prepare/apply) on the CPU.

Every kernel launch is carried out by ``cp_linear.kernels.emulation`` (the same algorithm in
torch, rounding where the kernels round), so this checks everything around the kernels, and the
blocked algorithm's precision, against the float64 reference without a GPU. The GPU tests
(``test_cutedsl_backend.py``) check the kernels against the same emulation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_api.gdp.cutedsl as cutedsl
from cp_linear.kernels import launch as kl
from cp_linear.kernels.emulation import run_emulated
from cp_linear.reference import naive_gated_delta_product
from tests.cp_linear.gdp_cases import rel_err
from tests.cutedsl_inputs import emulation_inputs as _inputs
from torch_api.gdp.types import GDPInputs


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(kl._Launch, "run", run_emulated)
    monkeypatch.setattr(cutedsl, "unsupported_reason", lambda inputs: None)
    monkeypatch.setattr(cutedsl, "_sm_count", lambda device: 132)



def _reference(q, k, v, g, beta, n_h, cu, initial=None):
    as64 = lambda x: x.double().numpy()  # noqa: E731
    o, final = naive_gated_delta_product(as64(q), as64(k), as64(v), as64(g), as64(beta), scale=q.shape[-1] ** -0.5,
                                         num_householder=n_h, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                         initial_state=None if initial is None else as64(initial))
    return o, final


# bf16 operands: the output's own bf16 rounding is ~1.7e-3; the blocked algorithm adds about as much
OUTPUT_LIMIT = 6e-3
STATE_LIMIT = 6e-3


@pytest.mark.parametrize("n_h", [1, 2, 3])
@pytest.mark.parametrize("segment_chunks", [None, 2])
def test_one_device_forward_matches_float64(emulated, n_h, segment_chunks):
    lengths = [150, 37, 301]
    q, k, v, g, beta = _inputs(lengths, heads=2, key_dim=64, value_dim=64, n_h=n_h, seed=n_h)
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    initial = torch.randn(len(lengths), 2, 64, 64, generator=torch.Generator().manual_seed(9)) * 0.1
    inputs = GDPInputs(q, k, v, g, beta, scale=64 ** -0.5, num_householder=n_h, use_qk_l2norm_in_kernel=True,
                       cu_seqlens=cu)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=segment_chunks)
    o, final, _ = backend.one_device_forward(inputs, initial)
    o_ref, final_ref = _reference(q, k, v, g, beta, n_h, cu.numpy(), initial)
    assert rel_err(o.float().numpy(), o_ref) < OUTPUT_LIMIT
    assert rel_err(final.numpy(), final_ref) < STATE_LIMIT


@pytest.mark.parametrize("layout", ["spanning", "packed", "rows"])
def test_cp_prepare_apply_over_two_shards_matches_one_device(emulated, layout):
    n_h, heads, dim = 2, 2, 64
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2)
    if layout == "rows":
        q, k, v, g, beta = _inputs([256], heads, dim, dim, n_h, seed=3, rows=2)
        cu_global, cu_local = None, [None, None]
        o_ref = np.concatenate([_reference(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], n_h,
                                           None)[0] for i in range(2)])
    else:
        lengths = [256] if layout == "spanning" else [60, 150, 46]
        q, k, v, g, beta = _inputs(lengths, heads, dim, dim, n_h, seed=4)
        cu_global = np.cumsum([0] + lengths)
        # shard at token 128: spanning -> [128] | [128]; packed -> [60, 68] | [82, 46]
        cu_local = [torch.tensor([0, 128] if layout == "spanning" else [0, 60, 128], dtype=torch.int32),
                    torch.tensor([0, 128] if layout == "spanning" else [0, 82, 128], dtype=torch.int32)]
        o_ref = _reference(q, k, v, g, beta, n_h, cu_global)[0]
    half = q.shape[1] // 2
    shards = []
    for rank in range(2):
        tok = slice(rank * half, (rank + 1) * half)
        step = slice(rank * half * n_h, (rank + 1) * half * n_h)
        shards.append(GDPInputs(q[:, tok], k[:, step], v[:, step], g[:, tok], beta[:, step], scale=dim ** -0.5,
                                num_householder=n_h, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_local[rank]))
    prepared = [backend.cp_forward_prepare(shard) for shard in shards]
    out0 = backend.cp_forward_apply(prepared[0][1], None).output
    preceding = prepared[0][0].packed[None]
    out1 = backend.cp_forward_apply(prepared[1][1], preceding).output
    o = torch.cat([out0, out1], dim=1).float().numpy()
    assert rel_err(o, o_ref) < OUTPUT_LIMIT
    if layout == "packed":  # the trailing sequence starts inside the shard: M = 0
        assert torch.count_nonzero(prepared[0][0].packed[..., dim:]) == 0


# bf16 operands in every backward product: measured 1.7-3.6e-3 here (the budget: 5e-3 for
# q, k, v, beta and 1e-2 for g); the rounding of dO to bf16 alone is ~1.7e-3
GRAD_LIMIT = 6e-3


@pytest.mark.parametrize("n_h, segment_chunks", [(1, None), (2, 2), (3, 3)])
def test_kernel_backward_matches_float64_gradients(emulated, n_h, segment_chunks):
    from cp_linear.kernels import backward_algorithm as ba
    from torch_api import gated_delta_product

    lengths = [150, 37, 301]
    heads, dim = 2, 64
    q, k, v, g, beta = _inputs(lengths, heads=heads, key_dim=dim, value_dim=dim, n_h=n_h, seed=20 + n_h)
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    gen = torch.Generator().manual_seed(5)
    initial = torch.randn(len(lengths), heads, dim, dim, generator=gen) * 0.1
    do = torch.randn(1, sum(lengths), heads, dim, generator=gen).bfloat16()
    dfinal = torch.randn(len(lengths), heads, dim, dim, generator=gen)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=segment_chunks, backward="kernels")
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, initial)]
    o, final = gated_delta_product(*leaves[:5], num_householder=n_h, cu_seqlens=cu, initial_state=leaves[5],
                                   use_qk_l2norm_in_kernel=True, backend=backend)
    torch.autograd.backward([o, final], [do, dfinal])
    # float64 reference gradients of the same (rounded) inputs, sequence by sequence
    starts = np.cumsum([0] + lengths)
    reference = [[] for _ in range(6)]
    for n, (t0, t1) in enumerate(zip(starts[:-1], starts[1:])):
        parts = [x[0].double() for x in (q[:, t0:t1], k[:, t0 * n_h:t1 * n_h], v[:, t0 * n_h:t1 * n_h],
                                         g[:, t0:t1], beta[:, t0 * n_h:t1 * n_h])]
        got = ba.sequence_backward(*parts, do[0, t0:t1].double(), dfinal[n].double(), num_householder=n_h,
                                   scale=dim ** -0.5, use_l2=True, initial_state=initial[n].double())
        for slot, grad in enumerate(got):
            reference[slot].append(grad)
    ref = [torch.cat(parts[:], 0) for parts in reference[:5]] + [torch.stack(reference[5])]
    for name, leaf, expected in zip(("q", "k", "v", "g", "beta", "initial"), leaves, ref):
        got = leaf.grad.float().reshape(expected.shape).numpy()
        assert rel_err(got, expected.numpy()) < GRAD_LIMIT, name


@pytest.mark.parametrize("layout", ["spanning", "packed", "rows"])
def test_kernel_cp_backward_over_two_shards_matches_float64(emulated, layout):
    from cp_linear.kernels import backward_algorithm as ba

    n_h, heads, dim = 2, 2, 64
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2, backward="kernels")
    rows = 2 if layout == "rows" else 1
    lengths = {"spanning": [256], "packed": [60, 150, 46], "rows": [256]}[layout]
    q, k, v, g, beta = _inputs(lengths, heads, dim, dim, n_h, seed=6, rows=rows)
    cu_local = [None, None] if layout == "rows" else (
        [torch.tensor([0, 128], dtype=torch.int32)] * 2 if layout == "spanning"
        else [torch.tensor([0, 60, 128], dtype=torch.int32), torch.tensor([0, 82, 128], dtype=torch.int32)])
    do = torch.randn(rows, sum(lengths), heads, dim, generator=torch.Generator().manual_seed(8)).bfloat16()
    half = q.shape[1] // 2
    shards = []
    for rank in range(2):
        tok = slice(rank * half, (rank + 1) * half)
        step = slice(rank * half * n_h, (rank + 1) * half * n_h)
        shards.append(GDPInputs(q[:, tok], k[:, step], v[:, step], g[:, tok], beta[:, step], scale=dim ** -0.5,
                                num_householder=n_h, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_local[rank]))
    prepared = [backend.cp_forward_prepare(shard) for shard in shards]
    saved = [backend.cp_forward_apply(prepared[0][1], None).saved_context,
             backend.cp_forward_apply(prepared[1][1], prepared[0][0].packed[None]).saved_context]
    backward = [backend.cp_backward_prepare(do[:, r * half:(r + 1) * half], saved[r]) for r in range(2)]
    grads = [backend.cp_backward_apply(backward[0][1], backward[1][0].packed[None]),
             backend.cp_backward_apply(backward[1][1], None)]
    got = {name: torch.cat([getattr(grads[r], name) for r in range(2)], dim=1)
           for name in ("dq", "dk", "dv", "dg", "dbeta")}
    # float64 reference, sequence by sequence (rows: each row is a sequence)
    starts = np.cumsum([0] + lengths)
    reference = {name: [] for name in got}
    for row in range(rows):
        for t0, t1 in zip(starts[:-1], starts[1:]):
            parts = [x[row].double() for x in (q[:, t0:t1], k[:, t0 * n_h:t1 * n_h], v[:, t0 * n_h:t1 * n_h],
                                               g[:, t0:t1], beta[:, t0 * n_h:t1 * n_h])]
            out = ba.sequence_backward(*parts, do[row, t0:t1].double(), torch.zeros(heads, dim, dim, dtype=torch.float64),
                                       num_householder=n_h, scale=dim ** -0.5, use_l2=True)
            for name, grad in zip(reference, out[:5]):
                reference[name].append((row, grad))
    for name in got:
        expected = torch.stack([torch.cat([grad for r, grad in reference[name] if r == row], 0) for row in range(rows)])
        assert rel_err(got[name].float().numpy(), expected.numpy()) < GRAD_LIMIT, name


def test_op_with_empty_sequences_matches_the_torch_backend(emulated):
    """Sequence states through the four functions: an empty sequence keeps its initial state and
    passes dL/d final state to dL/d initial state; gradients as TorchGDPBackend's."""
    from torch_api import gated_delta_product
    from torch_api.gdp.chunk import TorchGDPBackend

    lengths, n_h, heads, dim = [70, 0, 130, 0], 2, 2, 64
    q, k, v, g, beta = _inputs(lengths, heads, dim, dim, n_h, seed=31)
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    gen = torch.Generator().manual_seed(32)
    initial = torch.randn(len(lengths), heads, dim, dim, generator=gen) * 0.1
    do = torch.randn(1, sum(lengths), heads, dim, generator=gen).bfloat16()
    dfinal = torch.randn(len(lengths), heads, dim, dim, generator=gen)
    results = []
    for backend in (cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=1, backward="kernels"),
                    TorchGDPBackend()):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, initial)]
        o, final = gated_delta_product(*leaves[:5], num_householder=n_h, cu_seqlens=cu, initial_state=leaves[5],
                                       use_qk_l2norm_in_kernel=True, backend=backend)
        torch.autograd.backward([o, final], [do, dfinal])
        results.append([o.float(), final] + [leaf.grad.float() for leaf in leaves])
    assert torch.equal(results[0][1][1], initial[1]) and torch.equal(results[0][1][3], initial[3])
    assert torch.equal(results[0][7][1], dfinal[1]) and torch.equal(results[0][7][3], dfinal[3])
    for name, ours, theirs in zip(("o", "final", "q", "k", "v", "g", "beta", "initial"), *results):
        assert rel_err(ours.detach().numpy(), theirs.detach().numpy().astype(np.float64)) < GRAD_LIMIT, name


def test_cp_initial_state_on_the_first_rank_reaches_the_next(emulated):
    """Rank 0 starts the spanning sequence from S0; rank 1 holds the same S0 (replicated, as the CP
    frontends pass it) and folds rank 0's summary from it (M S0 + E), so its output continues from the
    right state."""
    n_h, heads, dim = 2, 2, 64
    q, k, v, g, beta = _inputs([256], heads, dim, dim, n_h, seed=33)
    g = g * 0.02  # a slow decay, so that S0 still matters on rank 1
    initial = torch.randn(1, heads, dim, dim, generator=torch.Generator().manual_seed(34))
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2)
    cu = torch.tensor([0, 128], dtype=torch.int32)
    shards = [GDPInputs(q[:, t], k[:, s], v[:, s], g[:, t], beta[:, s], scale=dim ** -0.5, num_householder=n_h,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu, initial_state=init, output_final_state=True)
              for t, s, init in ((slice(0, 128), slice(0, 256), initial), (slice(128, 256), slice(256, 512), initial))]
    summary0, local0 = backend.cp_forward_prepare(shards[0])
    summary1, local1 = backend.cp_forward_prepare(shards[1])
    (o0, end0), _ = backend.cp_forward_apply(local0, None)
    (o1, final), _ = backend.cp_forward_apply(local1, summary0.packed[None])
    o_ref, final_ref = _reference(q, k, v, g, beta, n_h, np.array([0, 256]), initial)
    assert rel_err(torch.cat([o0, o1], 1).float().numpy(), o_ref) < OUTPUT_LIMIT
    assert rel_err(final.numpy(), final_ref) < STATE_LIMIT
    # rank 0's summary applied to S0 is its end state (the output pass rounds differently from the
    # summary pass: both within the state budget)
    folded = summary0.packed[..., dim:] @ initial[0] + summary0.packed[..., :dim]
    assert rel_err(folded.numpy(), end0[0].numpy().astype(np.float64)) < STATE_LIMIT
