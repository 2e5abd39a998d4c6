"""CuTeDSL GDP forward kernels (``CuTeDSLGatedDeltaProductCPBackend``) on a CUDA GPU.

References are independent: the float64 numpy recurrence (``cp_linear.reference``) on the same
(rounded) inputs, and ``TorchGDPBackend`` on the inputs upcast to float32. Tolerances: float32
inputs 1e-4 relative L2 (float32 arithmetic throughout); bf16 / fp16 outputs 2e-3 (rounding the
output to bf16 alone costs about 1.7e-3).
The error-path test runs everywhere (the checks need no GPU); the rest is marked ``gpu``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cp_linear import build_packed_sequence_cp_metadata  # noqa: E402
from cp_linear.reference import naive_gated_delta_product, shard_forward_summary  # noqa: E402
from tests.cp_linear.gdp_cases import random_gdp_inputs, rel_err, seq_idx_from_lengths  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-3, "fp16": 2e-3}


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
    pytest.param("fp32", (63,), 1, 64, 64, 1, False, id="fp32-T63-H1-K64-V64-nh1"),
    pytest.param("fp32", (17, 90, 1, 40), 2, 128, 64, 2, True, id="fp32-docs17,90,1,40-H2-K128-V64-nh2-l2"),
    pytest.param("fp32", (150,), 3, 64, 128, 3, False, id="fp32-T150-H3-K64-V128-nh3"),
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
    assert rel_err(_host(o), ref_o) < TOLERANCE[dtype]
    assert rel_err(_host(final), ref_final) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("nh, l2norm", [(1, False), (2, True), (3, False)])
def test_bf16_output_matches_torch_backend_float32_path(nh, l2norm):
    from torch_api import TorchGDPBackend

    rng = np.random.default_rng(11 + nh)
    lengths = (700, 1, 300, 23)
    q, k, v, g, beta = _device_inputs(rng, torch.bfloat16, lengths=lengths, heads=3, key_dim=128,
                                      value_dim=128, num_householder=nh)
    cu = _cu(lengths)
    o, final, _ = _backend().one_device_forward(_inputs(q, k, v, g, beta, nh, l2norm, cu))
    ref_o, ref_final, _ = TorchGDPBackend().one_device_forward(
        _inputs(q.float(), k.float(), v.float(), g, beta, nh, l2norm, cu))
    assert rel_err(_host(o), _host(ref_o)) < 2e-3
    assert rel_err(_host(final), _host(ref_final)) < 1e-4


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
    q, k, v, g, beta = _device_inputs(rng, torch.float32, lengths=lengths, heads=2, key_dim=64, value_dim=128,
                                      num_householder=nh)
    shards, gathered, output = _cp_on_one_device(_backend(), q, k, v, g, beta, nh, l2norm, lengths, cp_size)
    ref_o, _ = naive_gated_delta_product(*(_host(x) for x in (q, k, v, g, beta)), num_householder=nh,
                                         cu_seqlens=_cu(lengths).cpu().numpy(), use_qk_l2norm_in_kernel=l2norm)
    assert rel_err(_host(output), ref_o) < 1e-4
    for r, shard in enumerate(shards):
        ref_summary = shard_forward_summary(*(_host(x) for x in shard[1:5]), num_householder=nh,
                                            cu_seqlens=shard[5].cpu().numpy(), use_qk_l2norm_in_kernel=l2norm)
        assert rel_err(_host(gathered[r]), ref_summary) < 1e-4, f"summary of rank {r}"


@pytest.mark.gpu
def test_cp_rows_each_row_continues_across_ranks():
    backend, nh, cp_size, batch, tokens = _backend(), 2, 2, 2, 130
    rng = np.random.default_rng(5)
    q, k, v, g, beta = _device_inputs(rng, torch.float32, batch=batch, lengths=(tokens,), heads=2, key_dim=128,
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
    assert rel_err(_host(output), ref_o) < 1e-4


@pytest.mark.gpu
def test_gated_delta_product_runs_the_kernel_forward_and_torch_backward():
    from torch_api import TorchGDPBackend, gated_delta_product

    rng = np.random.default_rng(3)
    lengths = (40, 89)
    q, k, v, g, beta = _device_inputs(rng, torch.float32, lengths=lengths, heads=2, key_dim=64, value_dim=64,
                                      num_householder=2)
    cu = _cu(lengths)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, final = gated_delta_product(*leaves, num_householder=2, cu_seqlens=cu, backend=_backend())
    (o.square().sum() + final.sum()).backward()
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    ref_o, ref_final = gated_delta_product(*ref_leaves, num_householder=2, cu_seqlens=cu, backend=TorchGDPBackend())
    (ref_o.square().sum() + ref_final.sum()).backward()
    assert rel_err(_host(o), _host(ref_o)) < 1e-4
    for leaf, ref in zip(leaves, ref_leaves):
        assert rel_err(_host(leaf.grad), _host(ref.grad)) < 1e-3


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
    assert rel_err(_host(o), _host(ref_o)) < 2e-3
    assert rel_err(_host(final), _host(ref_final)) < 1e-4


@pytest.mark.parametrize("key_dim", [pytest.param(96, id="K96-unsupported"), pytest.param(64, id="cpu-tensors")])
def test_unsupported_inputs_raise_value_error(key_dim):
    rng = np.random.default_rng(0)
    arrays = random_gdp_inputs(rng, tokens=8, heads=1, key_dim=key_dim, value_dim=64)
    q, k, v, g, beta = (torch.tensor(x, dtype=torch.float32) for x in arrays)
    with pytest.raises(ValueError, match="CuTeDSLGatedDeltaProductCPBackend"):
        _backend().cp_forward_prepare(_inputs(q, k, v, g, beta, 1, False, None))
