"""CuTeDSL tensor-core GDP forward (``CuTeDSLGatedDeltaProductCPBackend``) on a CUDA GPU.

References are independent: the float64 numpy recurrence (``cp_linear.reference``) on the same
(rounded) inputs; flash-linear-attention's forward on the same inputs when it is installed (the
precision yardstick: our error must be no larger than FLA's); and the launch-by-launch torch
emulation of the kernels (``cp_linear.kernels.emulation``), which the kernels must follow to
accumulation-order differences. Tolerances: bf16 operands in every product put the output within
a few 1e-3 of float64 (rounding the exact output to bf16 alone costs about 1.7e-3); states stay
float32. The error-path test runs everywhere (the checks need no GPU); the rest is marked ``gpu``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cp_linear import build_packed_sequence_cp_metadata  # noqa: E402
from cp_linear.reference import naive_gated_delta_product, shard_forward_summary  # noqa: E402
from tests.cp_linear.gdp_cases import random_gdp_inputs, rel_err, seq_idx_from_lengths  # noqa: E402
from tests.torch_api.cp_shards import CP_BACKWARD_CASES, case_inputs, cp_forward_backward  # noqa: E402
from tests.torch_api.cp_shards import float64_reference  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
OUTPUT_TOLERANCE = 6e-3  # bf16/fp16 operands; see the module doc
STATE_TOLERANCE = 6e-3
SUMMARY_TOLERANCE = 6e-3


def _backend():
    from torch_api import CuTeDSLGatedDeltaProductCPBackend

    return CuTeDSLGatedDeltaProductCPBackend()


def _device_inputs(rng, dtype, *, batch=1, lengths=(63,), heads=2, key_dim=64, value_dim=64, num_householder=1):
    tokens = sum(lengths) if batch == 1 else lengths[0]
    arrays = random_gdp_inputs(rng, batch=batch, tokens=tokens, heads=heads, key_dim=key_dim,
                               value_dim=value_dim, num_householder=num_householder)
    q, k, v, g, beta = (torch.tensor(x, dtype=torch.float32, device="cuda") for x in arrays)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    return q, k, v, g, beta


def _host(x):
    return x.detach().float().cpu().numpy()


def _cu(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")


def _inputs(q, k, v, g, beta, num_householder, l2norm, cu_seqlens):
    from torch_api import GDPInputs

    return GDPInputs(q, k, v, g, beta, q.shape[-1] ** -0.5, num_householder, l2norm, cu_seqlens)


ONE_DEVICE_CASES = [
    pytest.param("bf16", (63,), 1, 64, 64, 1, False, id="bf16-T63-H1-K64-V64-nh1"),
    pytest.param("bf16", (17, 90, 1, 40), 2, 128, 64, 2, True, id="bf16-docs17,90,1,40-H2-K128-V64-nh2-l2"),
    pytest.param("fp16", (150,), 3, 64, 128, 3, False, id="fp16-T150-H3-K64-V128-nh3"),
    pytest.param("bf16", (200, 33), 2, 128, 128, 2, True, id="bf16-docs200,33-H2-K128-V128-nh2-l2"),
    pytest.param("bf16", (5, 129, 64), 2, 64, 64, 3, False, id="bf16-docs5,129,64-H2-K64-V64-nh3"),
    pytest.param("bf16", (301,), 2, 128, 128, 1, False, id="bf16-T301-H2-K128-V128-nh1"),
    pytest.param("fp16", (77, 50), 2, 128, 64, 2, True, id="fp16-docs77,50-H2-K128-V64-nh2-l2"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, lengths, heads, key_dim, value_dim, nh, l2norm", ONE_DEVICE_CASES)
def test_one_device_forward_matches_float64_recurrence(dtype, lengths, heads, key_dim, value_dim, nh, l2norm):
    rng = np.random.default_rng(sum(lengths) + 7 * nh)
    q, k, v, g, beta = _device_inputs(rng, DTYPES[dtype], lengths=lengths, heads=heads, key_dim=key_dim,
                                      value_dim=value_dim, num_householder=nh)
    cu = _cu(lengths) if len(lengths) > 1 else None
    initial = torch.randn(len(lengths), heads, key_dim, value_dim, device="cuda") * 0.1
    o, final, _ = _backend().one_device_forward(_inputs(q, k, v, g, beta, nh, l2norm, cu), initial)
    ref_o, ref_final = naive_gated_delta_product(
        *(_host(x) for x in (q, k, v, g, beta)), num_householder=nh, initial_state=_host(initial),
        cu_seqlens=None if cu is None else cu.cpu().numpy(), use_qk_l2norm_in_kernel=l2norm)
    assert o.dtype == q.dtype and o.shape == q.shape[:3] + (value_dim,)
    assert rel_err(_host(o), ref_o) < OUTPUT_TOLERANCE
    assert rel_err(_host(final), ref_final) < STATE_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("nh, l2norm", [(1, False), (2, True), (3, True)])
def test_error_is_no_larger_than_flash_linear_attention(nh, l2norm):
    fla = pytest.importorskip("fla.ops.gated_delta_product")
    rng = np.random.default_rng(21 + nh)
    lengths = (1500, 700, 1848)
    q, k, v, g, beta = _device_inputs(rng, torch.bfloat16, lengths=lengths, heads=4, key_dim=128,
                                      value_dim=128, num_householder=nh)
    cu = _cu(lengths)
    o, _, _ = _backend().one_device_forward(_inputs(q, k, v, g, beta, nh, l2norm, cu))
    o_fla = fla.chunk_gated_delta_product(q, k, v, g, beta, num_householder=nh, use_qk_l2norm_in_kernel=l2norm,
                                          cu_seqlens=cu)[0]
    ref_o, _ = naive_gated_delta_product(*(_host(x) for x in (q, k, v, g, beta)), num_householder=nh,
                                         cu_seqlens=cu.cpu().numpy(), use_qk_l2norm_in_kernel=l2norm)
    assert rel_err(_host(o), ref_o) <= rel_err(_host(o_fla), ref_o)


@pytest.mark.gpu
@pytest.mark.parametrize("segment_chunks, mma", [(None, "sync"), (3, "sync"), (None, "wgmma"), (3, "wgmma")])
def test_kernels_follow_their_emulation(segment_chunks, mma, monkeypatch):
    """Output and final state of the GPU kernels against the same launches emulated in torch
    (on CPU copies), i.e. the same algorithm and roundings in another accumulation order."""
    from cp_linear.kernels import launch as kl
    from cp_linear.kernels.emulation import run_emulated
    import torch_api.gdp.cutedsl as cutedsl

    rng = np.random.default_rng(4)
    lengths = (300, 5, 700)
    q, k, v, g, beta = _device_inputs(rng, torch.bfloat16, lengths=lengths, heads=2, key_dim=128,
                                      value_dim=128, num_householder=2)
    cu = _cu(lengths)
    initial = torch.randn(len(lengths), 2, 128, 128, device="cuda") * 0.1
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=segment_chunks, mma=mma)
    o, final, _ = backend.one_device_forward(_inputs(q, k, v, g, beta, 2, True, cu), initial)
    cpu = [x.cpu() for x in (q, k, v, g, beta)]
    monkeypatch.setattr(kl._Launch, "run", run_emulated)
    monkeypatch.setattr(cutedsl, "unsupported_reason", lambda inputs: None)
    o_emu, final_emu, _ = backend.one_device_forward(_inputs(*cpu, 2, True, cu.cpu()), initial.cpu())
    assert rel_err(_host(o), _host(o_emu)) < 2e-3
    assert rel_err(_host(final), _host(final_emu)) < 2e-3


@pytest.mark.gpu
def test_forward_is_bitwise_repeatable():
    rng = np.random.default_rng(8)
    lengths = (900, 1100)
    q, k, v, g, beta = _device_inputs(rng, torch.bfloat16, lengths=lengths, heads=2, key_dim=128,
                                      value_dim=128, num_householder=2)
    inputs = _inputs(q, k, v, g, beta, 2, True, _cu(lengths))
    backend = _backend()
    first = backend.one_device_forward(inputs)[:2]
    second = backend.one_device_forward(inputs)[:2]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def _cp_on_one_device(backend, q, k, v, g, beta, nh, l2norm, lengths, cp_size):
    """Every rank's prepare, the gathered summaries and every rank's apply, on one GPU."""
    metas = [build_packed_sequence_cp_metadata(seq_idx_from_lengths(lengths), r, cp_size) for r in range(cp_size)]
    local = q.shape[1] // cp_size
    shards, summaries, contexts = [], [], []
    for r, meta in enumerate(metas):
        tok = slice(r * local, (r + 1) * local)
        stp = slice(r * local * nh, (r + 1) * local * nh)
        cu = torch.tensor(meta.local_cu_seqlens, dtype=torch.int32, device="cuda")
        shard = (q[:, tok], k[:, stp], v[:, stp], g[:, tok], beta[:, stp], cu)
        summary, context = backend.cp_forward_prepare(_inputs(*shard[:5], nh, l2norm, shard[5]))
        shards.append(shard)
        summaries.append(summary.packed)
        contexts.append(context)
    gathered = torch.stack(summaries)
    outputs = [backend.cp_forward_apply(contexts[r], gathered[metas[r].preceding_rank_start:r]).output
               for r in range(cp_size)]
    return shards, gathered, torch.cat(outputs, dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("cp_size, lengths, nh, l2norm", [
    pytest.param(2, (256,), 2, False, id="cp2-one-doc-nh2"),
    pytest.param(4, (37, 300, 47, 128), 1, True, id="cp4-docs-across-ranks-nh1-l2"),
    pytest.param(3, (500, 7), 3, False, id="cp3-doc-spans-three-ranks-nh3"),
])
def test_cp_shards_compose_to_the_whole_sequence(cp_size, lengths, nh, l2norm):
    rng = np.random.default_rng(cp_size * 100 + nh)
    q, k, v, g, beta = _device_inputs(rng, torch.bfloat16, lengths=lengths, heads=2, key_dim=64, value_dim=128,
                                      num_householder=nh)
    from torch_api.gdp.cutedsl import CuTeDSLGatedDeltaProductCPBackend

    backend = CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2)  # several segments per shard
    shards, gathered, output = _cp_on_one_device(backend, q, k, v, g, beta, nh, l2norm, lengths, cp_size)
    ref_o, _ = naive_gated_delta_product(*(_host(x) for x in (q, k, v, g, beta)), num_householder=nh,
                                         cu_seqlens=_cu(lengths).cpu().numpy(), use_qk_l2norm_in_kernel=l2norm)
    local = q.shape[1] // cp_size
    per_rank = [rel_err(_host(output[:, r * local:(r + 1) * local]), ref_o[:, r * local:(r + 1) * local])
                for r in range(cp_size)]
    assert rel_err(_host(output), ref_o) < OUTPUT_TOLERANCE, f"output error per rank {per_rank}"
    value_dim = v.shape[-1]
    for r, shard in enumerate(shards):
        ref_summary = shard_forward_summary(*(_host(x) for x in shard[1:5]), num_householder=nh,
                                            cu_seqlens=shard[5].cpu().numpy(), use_qk_l2norm_in_kernel=l2norm)
        got = _host(gathered[r])
        parts = (rel_err(got[..., :value_dim], ref_summary[..., :value_dim]),
                 float(np.abs(got[..., value_dim:] - ref_summary[..., value_dim:]).max()))
        assert rel_err(got, ref_summary) < SUMMARY_TOLERANCE, f"summary of rank {r}: E rel, M max abs diff {parts}"


@pytest.mark.gpu
def test_cp_rows_each_row_continues_across_ranks():
    backend, nh, cp_size, batch, tokens = _backend(), 2, 2, 2, 130
    rng = np.random.default_rng(5)
    q, k, v, g, beta = _device_inputs(rng, torch.bfloat16, batch=batch, lengths=(tokens,), heads=2, key_dim=128,
                                      value_dim=64, num_householder=nh)
    local = tokens // cp_size
    summaries, contexts = [], []
    for r in range(cp_size):
        tok, stp = slice(r * local, (r + 1) * local), slice(r * local * nh, (r + 1) * local * nh)
        summary, context = backend.cp_forward_prepare(
            _inputs(q[:, tok], k[:, stp], v[:, stp], g[:, tok], beta[:, stp], nh, False, None))
        assert summary.packed.shape == (batch, 2, 128, 64 + 128)
        summaries.append(summary.packed)
        contexts.append(context)
    gathered = torch.stack(summaries)
    output = torch.cat([backend.cp_forward_apply(contexts[r], gathered[:r]).output for r in range(cp_size)], dim=1)
    ref_o, _ = naive_gated_delta_product(*(_host(x) for x in (q, k, v, g, beta)), num_householder=nh)
    assert rel_err(_host(output), ref_o) < OUTPUT_TOLERANCE


@pytest.mark.gpu
def test_gated_delta_product_runs_the_kernel_forward_and_torch_backward():
    from torch_api import CuTeDSLGatedDeltaProductCPBackend, TorchGDPBackend, gated_delta_product

    rng = np.random.default_rng(3)
    lengths = (40, 89)
    q, k, v, g, beta = _device_inputs(rng, torch.bfloat16, lengths=lengths, heads=2, key_dim=64, value_dim=64,
                                      num_householder=2)
    cu = _cu(lengths)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, final = gated_delta_product(*leaves, num_householder=2, cu_seqlens=cu,
                                   backend=CuTeDSLGatedDeltaProductCPBackend(backward="torch"))
    (o.square().sum() + final.sum()).backward()
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    ref_o, ref_final = gated_delta_product(*ref_leaves, num_householder=2, cu_seqlens=cu, backend=TorchGDPBackend())
    (ref_o.square().sum() + ref_final.sum()).backward()
    assert rel_err(_host(o), _host(ref_o)) < OUTPUT_TOLERANCE
    # the backward recomputes in torch (the reference's own code path), but its incoming gradient
    # 2 o carries the forward's bf16-operand error, so gradients agree to that level
    for leaf, ref in zip(leaves, ref_leaves):
        assert rel_err(_host(leaf.grad), _host(ref.grad)) < OUTPUT_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [65536])
def test_long_packed_sequence_matches_torch_backend(tokens):
    from torch_api import TorchGDPBackend

    rng = np.random.default_rng(1)
    lengths = (30000, 1, 20535, tokens - 50536)
    q, k, v, g, beta = _device_inputs(rng, torch.bfloat16, lengths=lengths, heads=4, key_dim=128, value_dim=128,
                                      num_householder=2)
    cu = _cu(lengths)
    o, final, _ = _backend().one_device_forward(_inputs(q, k, v, g, beta, 2, True, cu))
    ref_o, ref_final, _ = TorchGDPBackend().one_device_forward(
        _inputs(q.float(), k.float(), v.float(), g, beta, 2, True, cu))
    assert rel_err(_host(o), _host(ref_o)) < OUTPUT_TOLERANCE
    assert rel_err(_host(final), _host(ref_final)) < STATE_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("fault, message", [("nan_k", r"non-finite values \(NaN or Inf\) in k$"),
                                            ("positive_g", r"g > 0"), ("beta_3", r"beta outside")])
def test_value_checks_read_after_the_queued_forward_still_raise_on_the_gpu(fault, message):
    """On CUDA the checks reach the host by a non-blocking copy read after the forward is queued
    (``PendingValueChecks``); the error is the one the CPU path raises, and clean inputs pass."""
    from torch_api import gated_delta_product

    rng = np.random.default_rng(5)
    q, k, v, g, beta = _device_inputs(rng, torch.bfloat16, lengths=(100,), heads=2, key_dim=128, value_dim=128,
                                      num_householder=2)
    options = dict(num_householder=2, use_qk_l2norm_in_kernel=True, backend=_backend())
    o, _ = gated_delta_product(q, k, v, g, beta, **options)
    assert bool(torch.isfinite(o).all())
    if fault == "nan_k":
        k = k.clone()
        k[0, 37, 1, 5] = float("nan")
    elif fault == "positive_g":
        g = g.clone()
        g[0, 12, 0] = 0.5
    else:
        beta = beta.clone()
        beta[0, 3, 1] = 3.0
    with pytest.raises(ValueError, match=rf"gated_delta_product: .*{message}"):
        gated_delta_product(q, k, v, g, beta, **options)


@pytest.mark.parametrize("key_dim, dtype", [pytest.param(96, torch.bfloat16, id="K96-unsupported"),
                                            pytest.param(64, torch.bfloat16, id="cpu-tensors"),
                                            pytest.param(64, torch.float32, id="float32-inputs")])
def test_unsupported_inputs_fall_back_to_torch_with_the_reason_or_raise(key_dim, dtype):
    from torch_api import TorchGDPBackend
    from torch_api.gdp.cutedsl import CuTeDSLGatedDeltaProductCPBackend

    rng = np.random.default_rng(0)
    arrays = random_gdp_inputs(rng, tokens=8, heads=1, key_dim=key_dim, value_dim=64)
    q, k, v, g, beta = (torch.tensor(x, dtype=torch.float32) for x in arrays)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    inputs = _inputs(q, k, v, g, beta, 1, False, None)
    with pytest.raises(ValueError, match="CuTeDSLGatedDeltaProductCPBackend: the kernels"):
        CuTeDSLGatedDeltaProductCPBackend(fallback=False).cp_forward_prepare(inputs)
    backend = CuTeDSLGatedDeltaProductCPBackend()
    with pytest.warns(UserWarning, match="runs TorchGDPBackend: the kernels"):
        summary, context = backend.cp_forward_prepare(inputs)
    output = backend.cp_forward_apply(context, None).output
    ref_summary, ref_context = TorchGDPBackend().cp_forward_prepare(inputs)
    assert torch.equal(summary.packed, ref_summary.packed)
    assert torch.equal(output, TorchGDPBackend().cp_forward_apply(ref_context, None).output)


def _kernel_backward_grads(backend, q, k, v, g, beta, do, dfinal, nh, cu, initial=None):
    from torch_api import gated_delta_product

    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    init_leaf = None if initial is None else initial.clone().requires_grad_()
    o, final = gated_delta_product(*leaves, num_householder=nh, cu_seqlens=cu, initial_state=init_leaf,
                                   use_qk_l2norm_in_kernel=True, backend=backend)
    torch.autograd.backward([o, final], [do, dfinal])
    return [leaf.grad for leaf in leaves] + ([] if init_leaf is None else [init_leaf.grad])


# the budget for bf16 outputs and gradients: 5e-3 rel L2 (1e-2 for g)
GRAD_TOLERANCE = {"dq": 5e-3, "dk": 5e-3, "dv": 5e-3, "dg": 1e-2, "dbeta": 5e-3, "d_initial": 5e-3}
CP_STEP_TOLERANCE = {"output": 5e-3, **GRAD_TOLERANCE}  # the emulation measures 3.0-3.9e-3 on CP_BACKWARD_CASES


@pytest.mark.gpu
@pytest.mark.parametrize("nh, segment_chunks, dtype", [(1, None, "bfloat16"), (2, 3, "bfloat16"), (3, 2, "bfloat16"),
                                                       (2, 3, "float16")])
def test_kernel_backward_matches_float64_gradients(nh, segment_chunks, dtype):
    from cp_linear.kernels import backward_algorithm as ba
    from torch_api.gdp.cutedsl import CuTeDSLGatedDeltaProductCPBackend

    lengths, heads, dim = (400, 37, 600), 2, 128
    rng = np.random.default_rng(31 + nh)
    q, k, v, g, beta = _device_inputs(rng, getattr(torch, dtype), lengths=lengths, heads=heads, key_dim=dim,
                                      value_dim=dim, num_householder=nh)
    cu = _cu(lengths)
    gen = torch.Generator(device="cuda").manual_seed(nh)
    do = torch.randn(1, sum(lengths), heads, dim, device="cuda", generator=gen).to(getattr(torch, dtype))
    dfinal = torch.randn(len(lengths), heads, dim, dim, device="cuda", generator=gen)
    initial = torch.randn(len(lengths), heads, dim, dim, device="cuda", generator=gen) * 0.1
    backend = CuTeDSLGatedDeltaProductCPBackend(segment_chunks=segment_chunks, backward="kernels")
    got = _kernel_backward_grads(backend, q, k, v, g, beta, do, dfinal, nh, cu, initial)
    starts = np.cumsum([0] + list(lengths))
    ref = [[] for _ in range(6)]
    for n, (t0, t1) in enumerate(zip(starts[:-1], starts[1:])):
        parts = [x[0].double().cpu() for x in (q[:, t0:t1], k[:, t0 * nh:t1 * nh], v[:, t0 * nh:t1 * nh],
                                               g[:, t0:t1], beta[:, t0 * nh:t1 * nh])]
        out = ba.sequence_backward(*parts, do[0, t0:t1].double().cpu(), dfinal[n].double().cpu(), num_householder=nh,
                                   scale=dim ** -0.5, use_l2=True, initial_state=initial[n].double().cpu())
        for slot in range(6):
            ref[slot].append(out[slot])
    expected = [torch.cat(parts, 0) for parts in ref[:5]] + [torch.stack(ref[5])]
    for name, grad, want in zip(GRAD_TOLERANCE, got, expected):
        assert rel_err(_host(grad).reshape(want.shape), want.numpy()) < GRAD_TOLERANCE[name], name


@pytest.mark.gpu
def test_kernel_backward_follows_its_emulation_and_repeats_bitwise(monkeypatch):
    from cp_linear.kernels import launch as kl
    from cp_linear.kernels.emulation import run_emulated
    import torch_api.gdp.cutedsl as cutedsl

    lengths, nh = (300, 700), 2
    rng = np.random.default_rng(12)
    q, k, v, g, beta = _device_inputs(rng, torch.bfloat16, lengths=lengths, heads=2, key_dim=128, value_dim=128,
                                      num_householder=nh)
    cu = _cu(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    do = torch.randn(1, sum(lengths), 2, 128, device="cuda", generator=gen).bfloat16()
    dfinal = torch.randn(len(lengths), 2, 128, 128, device="cuda", generator=gen)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=3, backward="kernels")
    first = _kernel_backward_grads(backend, q, k, v, g, beta, do, dfinal, nh, cu)
    second = _kernel_backward_grads(backend, q, k, v, g, beta, do, dfinal, nh, cu)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    monkeypatch.setattr(kl._Launch, "run", run_emulated)
    monkeypatch.setattr(cutedsl, "unsupported_reason", lambda inputs: None)
    cpu = [x.cpu() for x in (q, k, v, g, beta, do, dfinal)]
    emulated = _kernel_backward_grads(backend, *cpu[:5], cpu[5], cpu[6], nh, cu.cpu())
    for name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta"), first, emulated):
        assert rel_err(_host(got), _host(want)) < 2e-3, name


@pytest.mark.gpu
@pytest.mark.parametrize("case", CP_BACKWARD_CASES, ids=lambda case: case.id)
def test_cp_backward_shards_compose_to_float64_gradients(case):
    """W ranks' CP forward + backward on one GPU (``cp_shards``: every rank's prepare, the gathered
    summaries sliced per rank as ``torch_api.gdp.cp`` slices them, every apply) against the float64
    reference of the whole packed problem, within the issue's bf16 budget; a second step is bitwise
    the same (no atomics, fixed launch plans)."""
    from torch_api.gdp.cutedsl import CuTeDSLGatedDeltaProductCPBackend

    q, k, v, g, beta, do = case_inputs(case, dtype=torch.bfloat16, device="cuda", seed=40 + case.cp_size)
    backend = CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2, backward="kernels")  # several segments per shard
    options = dict(num_householder=case.num_householder, l2norm=case.l2norm)
    got = cp_forward_backward(backend, q, k, v, g, beta, do, case.lengths, case.cp_size, **options)
    again = cp_forward_backward(backend, q, k, v, g, beta, do, case.lengths, case.cp_size, **options)
    expected = float64_reference(q, k, v, g, beta, do, case.lengths, **options)
    errors = {name: rel_err(_host(mine), want.numpy()) for name, mine, want in zip(got._fields, got, expected)}
    for name, mine, want in zip(got._fields, got, expected):
        assert mine.shape == want.shape, name
        assert errors[name] <= CP_STEP_TOLERANCE[name], f"{name}: rel L2 errors {errors}"
    for name, first, second in zip(got._fields, got, again):
        assert torch.equal(first, second), f"{name} differs between two identical steps"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CP_BACKWARD_CASES[:2], ids=lambda case: case.id)
def test_cp_protocol_never_waits_for_the_device(case):
    """Every rank's four protocol calls (after a warm-up step) raise nothing under sync debug mode "error":
    no host read, and no copy from pageable host memory, which waits for the stream first (a 0-d host
    tensor in a ``torch.where`` did, draining the forward's queue: H100, 2026-12-07)."""
    from tests.torch_api.cp_shards import cp_backward, cp_forward, split_into_shards
    from torch_api.gdp.cutedsl import CuTeDSLGatedDeltaProductCPBackend
    from torch_api.gdp.types import float32_region

    q, k, v, g, beta, do = case_inputs(case, dtype=torch.bfloat16, device="cuda", seed=50 + case.cp_size)
    backend = CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2, backward="kernels")
    options = dict(num_householder=case.num_householder, l2norm=case.l2norm)
    shards = split_into_shards(q, k, v, g, beta, case.lengths, case.cp_size, **options)  # host lists to the device
    for checked in (False, True):  # the first step compiles and caches
        torch.cuda.synchronize()
        if checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with float32_region(q.device):
                forward = cp_forward(backend, shards)
                cp_backward(backend, shards, do, forward.saved_contexts)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(RuntimeError):  # the mode is live here
        torch.cuda.set_sync_debug_mode("error")
        try:
            q.sum().item()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("key_dim, value_dim", [(128, 128), (64, 128), (128, 64)])
@pytest.mark.parametrize("init_count", [0, 1, 4])
def test_segment_fold_apply_affine_follows_its_emulation_and_the_sequential_fold(key_dim, value_dim, init_count,
                                                                                   monkeypatch):
    """segment_fold on the GPU: the double-buffered sequential fold and the prefix fold + mode
    "apply_affine" (the forward's one-fold plan) against their emulation, against each other (same
    incoming states, another rounding order), unused rows zero, and bitwise repeatable."""
    from cp_linear.kernels import launch as kl
    from cp_linear.kernels.emulation import run_emulated
    from tests.cutedsl_inputs import fold_both_ways, fold_summaries

    heads = 3
    summaries, starts = fold_summaries([3, 0, 9, 1], 2, heads, key_dim, value_dim, seed=61, device="cuda")
    init = torch.randn(4, heads, value_dim, key_dim, device="cuda")
    sequential, via_prefix, prefix = fold_both_ways(summaries, starts, init, init_count, value_dim)
    again = fold_both_ways(summaries, starts, init, init_count, value_dim)
    assert torch.equal(sequential, again[0]) and torch.equal(via_prefix, again[1])
    real = int(starts[-1])
    assert torch.count_nonzero(via_prefix[real:]) == 0
    assert rel_err(_host(via_prefix[:real]), _host(sequential[:real])) < 1e-5
    monkeypatch.setattr(kl._Launch, "run", run_emulated)
    emulated = fold_both_ways(summaries.cpu(), starts.cpu(), init.cpu(), init_count, value_dim)
    assert rel_err(_host(sequential[:real]), _host(emulated[0][:real])) < 1e-5
    assert rel_err(_host(prefix[:real]), _host(emulated[2][:real])) < 1e-5
    assert rel_err(_host(via_prefix), _host(emulated[1])) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("initial", [False, True])
def test_saved_segment_states_are_the_incoming_states(initial):
    """The forward's saved segment states (read by the kernel backward) after the fold dedup: each
    segment's incoming state, i.e. the sequential fold's (the forward before the dedup) to float32
    accumulation order, from zero or the initial state; unused rows zero; bitwise repeatable."""
    import torch_api.gdp.cutedsl as cutedsl
    from tests.cutedsl_inputs import fold_both_ways

    rng = np.random.default_rng(12)
    lengths = (700, 300, 1100)
    q, k, v, g, beta = _device_inputs(rng, torch.bfloat16, lengths=lengths, heads=2, key_dim=128,
                                      value_dim=128, num_householder=2)
    start = torch.randn(len(lengths), 2, 128, 128, device="cuda") * 0.1 if initial else None
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=4, backward="kernels")
    inputs = _inputs(q, k, v, g, beta, 2, True, _cu(lengths))
    _, _, saved = backend.one_device_forward(inputs, start)
    _, _, saved_again = backend.one_device_forward(inputs, start)
    states = backend.saved_segment_states(saved)
    assert torch.equal(states, backend.saved_segment_states(saved_again))
    _, local = backend.cp_forward_prepare(inputs)
    layout = local.shard.layout
    init = start.transpose(-1, -2).contiguous() if initial else states[:1]
    sequential, _, _ = fold_both_ways(local.shard.summaries, layout.seq_first_segment, init,
                                      len(lengths) if initial else 0, 128)
    real = int(layout.num_segments[0])
    assert rel_err(_host(states[:real]), _host(sequential[:real])) < 1e-5
    assert torch.count_nonzero(states[real:]) == 0
    # the saved summaries (written by the summary pass itself): defined in every row, zero where none was made
    regions = backend._saved_regions(inputs)
    saved_summaries = cutedsl._carve(cutedsl.kernel_saved_of(saved), regions)["summaries"]
    assert torch.equal(saved_summaries, cutedsl._carve(cutedsl.kernel_saved_of(saved_again), regions)["summaries"])
    flags = layout.seg_flags.cpu()
    unsummarised = [segment for segment in range(saved_summaries.shape[0]) if segment >= real or not flags[segment]]
    assert len(unsummarised) >= len(lengths) and torch.count_nonzero(saved_summaries[unsummarised]) == 0


@pytest.mark.gpu
def test_prefix_fold_writes_only_the_trailing_sequences_final_rows():
    """FINAL_TRAILING writes only the trailing sequences' final rows (``check_trailing_final_rows``)."""
    from tests.cutedsl_inputs import check_trailing_final_rows

    check_trailing_final_rows("cuda")


@pytest.mark.gpu
def test_fold_shortcuts_match_the_plain_fold():
    """FINAL_LEADING, ADD_TRAILING, ADD_EVERY and ``transition_count`` on the GPU (``check_fold_modes``)."""
    from tests.cutedsl_inputs import check_fold_modes

    check_fold_modes("cuda")


# --------------------------------------------------------------------------- containment: the token-flags route


def _contained_step(backend, inputs, initial, cu, check_inputs, launches, monkeypatch):
    """gated_delta_product forward and backward (output gradients everywhere, poisoned outputs included) with
    every launch recorded as (name, copies, contained) -> [o, final, dq, dk, dv, dg, dbeta, d initial]."""
    from cp_linear.kernels import launch as kl
    from torch_api import gated_delta_product

    original = kl._Launch.run
    record = (lambda launch: (launches.append((type(launch).__name__, getattr(launch.config, "copies", None),
                                                getattr(launch.config, "contained", None))), original(launch)))
    monkeypatch.setattr(kl._Launch, "run", record)
    leaves = [x.clone().requires_grad_() for x in (*inputs, initial)]
    o, final = gated_delta_product(*leaves[:5], num_householder=2, cu_seqlens=cu, initial_state=leaves[5],
                                   use_qk_l2norm_in_kernel=True, backend=backend, check_inputs=check_inputs)
    gen = torch.Generator(device="cuda").manual_seed(1)
    torch.autograd.backward([o, final], [torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype),
                                         torch.randn(final.shape, device="cuda", generator=gen)])
    monkeypatch.setattr(kl._Launch, "run", original)
    return [o, final, *(x.grad for x in leaves)]


def _contained_inputs_on_gpu(dirty: bool):
    """bf16 q, k, v (K = V = 128, H = 4, n_h = 2) and float32 g, beta of three packed sequences, with (dirty)
    NaN / ±Inf in every input and in one initial state; the initial states; cu_seqlens."""
    from tests.cutedsl_inputs import emulation_inputs

    lengths, n_h = [700, 300, 1048], 2
    inputs = [x.cuda() for x in emulation_inputs(lengths, 4, 128, 128, n_h, seed=5)]
    initial = torch.randn(3, 4, 128, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    initial = initial * 0.1
    if dirty:
        inputs[1][0, 100 * n_h + 1, 1, 7] = float("nan")  # k, token 100 (sequence 0), head 1
        inputs[0][0, 500, 0, 3] = float("inf")  # q, token 500: that output alone
        inputs[3][0, 1500, 2] = -float("inf")  # g, token 1500 (sequence 2), head 2
        inputs[4][0, 1800 * n_h + 1, 3] = float("nan")  # beta, token 1800, head 3
        inputs[2][0, 900 * n_h, 0, 0] = float("nan")  # v, token 900 (sequence 1), head 0
        initial[1, 3, 5, 5] = float("nan")  # sequence 1, head 3: every output of it
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32, device="cuda")
    return inputs, initial, cu


def _bitwise(name, got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("backward", ["kernels", "torch"])
def test_contained_flags_route_equals_the_copies_route_with_nonfinite_inputs(monkeypatch, backward):
    """check_inputs=False on the kernels with NaN / ±Inf in q, k, v, g, beta and an initial state: the flags
    route (one flags-only token-checks launch, contained chunk kernels that zero the flagged rows and store
    NaN at the poisoned tokens, no select over o) against the copies route (the same backend with
    ``zeroes_flagged_rows`` off: one launch with sanitised copies, the plain kernels, the op's select).
    Outputs, final states and gradients bit for bit, NaN where NaN: every finite output reads the same values
    in the same order (a flagged row reaches only poisoned outputs, whose output gradient is zero), as the
    emulation shows (tests/torch_api/test_isolation_flags.py)."""
    from torch_api.gdp.cutedsl import CuTeDSLGatedDeltaProductCPBackend

    inputs, initial, cu = _contained_inputs_on_gpu(dirty=True)
    results, launches = {}, {}
    for route in ("flags", "copies"):
        backend = CuTeDSLGatedDeltaProductCPBackend(backward=backward)
        if route == "copies":
            backend.zeroes_flagged_rows = False
        launches[route] = []
        results[route] = _contained_step(backend, inputs, initial, cu, False, launches[route], monkeypatch)
    for route, flags in (("flags", True), ("copies", False)):
        assert [copies for name, copies, _ in launches[route] if name == "TokenChecksLaunch"] == [not flags], route
        assert {contained for _, _, contained in launches[route] if contained is not None} == {flags}, route
    for name, got, want in zip(("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dinitial"), results["flags"],
                               results["copies"]):
        _bitwise(name, got, want)
    o = results["flags"][0]
    assert o[0, 500, 0].isnan().all() and not o[0, :100].isnan().any() and o[0, 700:1000, 3].isnan().all()
    assert all(torch.isfinite(grad).all() for grad in results["flags"][2:])


@pytest.mark.gpu
def test_contained_flags_route_on_finite_inputs_equals_the_checked_op_bitwise(monkeypatch):
    """Finite inputs: check_inputs=False (the flags route: contained kernels with no flag set, any_flagged 0)
    gives what check_inputs=True (the plain kernels) gives, bit for bit: outputs, final states, gradients."""
    from torch_api.gdp.cutedsl import CuTeDSLGatedDeltaProductCPBackend

    inputs, initial, cu = _contained_inputs_on_gpu(dirty=False)
    backend = CuTeDSLGatedDeltaProductCPBackend()
    launches = {True: [], False: []}
    results = {check: _contained_step(backend, inputs, initial, cu, check, launches[check], monkeypatch)
               for check in (False, True)}
    assert [copies for name, copies, _ in launches[False] if name == "TokenChecksLaunch"] == [False]
    assert {contained for _, _, contained in launches[False] if contained is not None} == {True}
    assert {contained for _, _, contained in launches[True] if contained is not None} == {False}
    for name, got, want in zip(("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dinitial"), results[False],
                               results[True]):
        _bitwise(name, got, want)
