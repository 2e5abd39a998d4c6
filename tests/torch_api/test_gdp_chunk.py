"""TorchGDPBackend and gated_delta_product on one process, against float64 references.

Oracles: ``torch_api.gdp.naive`` run in float64 under autograd (outputs, final states and every
gradient) and ``cp_linear.reference`` (numpy float64) for the shard summaries.
"""

import numpy as np
import pytest
import torch

from cp_linear import build_packed_sequence_cp_metadata
from cp_linear import reference as ref
from cp_linear.summary import CPBackwardPackedSummary, CPForwardPackedSummary
from tests.cp_linear.gdp_cases import random_gdp_inputs, rel_err, seq_idx_from_lengths
from tests.tolerance import gdp_length, tolerance, unit_roundoff
from torch_api.gdp.chunk import TorchGDPBackend
from torch_api.gdp.naive import naive_gated_delta_product
from torch_api.gdp.ops import gated_delta_product
from torch_api.gdp.types import GDPInputs

NAMES = ("q", "k", "v", "g", "beta")


# --------------------------------------------------------------------------- shared helpers


def gdp_arrays(seed, *, batch=1, tokens, heads=2, key_dim=8, value_dim=6, num_householder=1, l2norm=False):
    """Random float64 numpy inputs; with l2norm, q and k get arbitrary norms (the kernel normalises)."""
    rng = np.random.default_rng(seed)
    q, k, v, g, beta = random_gdp_inputs(rng, batch=batch, tokens=tokens, heads=heads, key_dim=key_dim,
                                         value_dim=value_dim, num_householder=num_householder)
    if l2norm:
        q = q * rng.uniform(0.3, 3.0, size=q.shape[:-1] + (1,))
        k = k * rng.uniform(0.3, 3.0, size=k.shape[:-1] + (1,))
    return q, k, v, g, beta


def oracle(arrays, *, num_householder=1, cu_seqlens=None, l2norm=False, initial_state=None, output_grad=None,
           final_state_grad=None, scale=None):
    """float64 naive recurrence under autograd -> dict of numpy: o, final, dq..dbeta, dinitial."""
    leaves = [torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in arrays]
    init = None if initial_state is None else torch.tensor(np.asarray(initial_state, np.float64), requires_grad=True)
    o, final = naive_gated_delta_product(*leaves, scale=scale, num_householder=num_householder, initial_state=init,
                                         cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=l2norm)
    loss = o.new_zeros(())
    if output_grad is not None:
        loss = loss + (o * torch.as_tensor(np.asarray(output_grad, np.float64))).sum()
    if final_state_grad is not None:
        loss = loss + (final * torch.as_tensor(np.asarray(final_state_grad, np.float64))).sum()
    loss.backward()
    out = {"o": o.detach().numpy(), "final": final.detach().numpy()}
    out.update({f"d{name}": np.zeros(leaf.shape) if leaf.grad is None else leaf.grad.numpy()
                for name, leaf in zip(NAMES, leaves)})
    if init is not None:
        out["dinitial"] = init.grad.numpy()
    return out


def gdp_tolerance(tokens, num_householder, key_dim, dtype=torch.float32):
    """Bound for outputs, states and gradients of GDP over ``tokens`` (tests/tolerance.py): the float32
    computation, plus one rounding of the result when it is returned in a half-precision dtype."""
    stored = 0.0 if dtype == torch.float32 else unit_roundoff(dtype)
    return stored + tolerance(gdp_length(tokens, num_householder, key_dim))


def check_close(name, out, expected, tol):
    out = out.detach().double().numpy() if isinstance(out, torch.Tensor) else out
    if not np.any(expected):  # e.g. dq when only the final state is differentiated
        assert not np.any(out), f"{name}: expected exact zeros"
        return
    err = rel_err(out, expected)
    assert err <= tol, f"{name}: relative L2 error {err:.3e} > {tol:.3e}"


def to_torch(arrays, dtype=torch.float32):
    return [torch.tensor(np.asarray(x), dtype=dtype) for x in arrays]


def cu_from_lengths(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


# --------------------------------------------------------------------------- one device vs float64


ONE_DEVICE_CASES = [
    # id, dims, num_householder, lengths (None: rows), l2norm, chunk_size
    pytest.param(dict(batch=1, tokens=63, heads=2, key_dim=60, value_dim=100), 1, None, False, 64,
                 id="B1-T63-H2-K60-V100-nh1"),
    pytest.param(dict(batch=2, tokens=63, heads=3, key_dim=12, value_dim=10), 2, None, True, 64,
                 id="B2-T63-H3-K12-V10-nh2-l2norm"),
    pytest.param(dict(batch=1, tokens=70, heads=1, key_dim=16, value_dim=8), 3, [1, 1, 33, 1, 34], False, 64,
                 id="B1-T70-H1-nh3-varlen-one-token-docs"),
    pytest.param(dict(batch=1, tokens=150, heads=2, key_dim=8, value_dim=6), 2, [33, 64, 53], True, 64,
                 id="B1-T150-H2-nh2-varlen-docs-span-chunks-l2norm"),
    pytest.param(dict(batch=1, tokens=61, heads=2, key_dim=5, value_dim=7), 2, [1, 2, 1, 17, 1, 1, 30, 8], False, 8,
                 id="B1-T61-nh2-chunk8-many-docs"),
    pytest.param(dict(batch=3, tokens=29, heads=1, key_dim=6, value_dim=3), 3, None, False, 8,
                 id="B3-T29-nh3-chunk8-rows"),
]


@pytest.mark.parametrize("dims, num_householder, lengths, l2norm, chunk_size", ONE_DEVICE_CASES)
def test_one_device_matches_float64_recurrence_with_all_gradients(dims, num_householder, lengths, l2norm,
                                                                  chunk_size):
    arrays = gdp_arrays(7, num_householder=num_householder, l2norm=l2norm, **dims)
    rng = np.random.default_rng(8)
    cu = None if lengths is None else cu_from_lengths(lengths)
    sequences = dims["batch"] if lengths is None else len(lengths)
    state_shape = (sequences, dims["heads"], dims["key_dim"], dims["value_dim"])
    initial = rng.normal(size=state_shape)
    do = rng.normal(size=(dims["batch"], dims["tokens"], dims["heads"], dims["value_dim"]))
    dfinal = rng.normal(size=state_shape)
    expected = oracle(arrays, num_householder=num_householder, cu_seqlens=cu, l2norm=l2norm, initial_state=initial,
                      output_grad=do, final_state_grad=dfinal)

    leaves = [x.requires_grad_() for x in to_torch(arrays)]
    init = torch.tensor(initial, dtype=torch.float32, requires_grad=True)
    o, final = gated_delta_product(*leaves, num_householder=num_householder, initial_state=init,
                                   cu_seqlens=None if cu is None else torch.tensor(cu),
                                   use_qk_l2norm_in_kernel=l2norm, backend=TorchGDPBackend(chunk_size))
    assert o.dtype == torch.float32 and final.dtype == torch.float32 and final.shape == state_shape
    ((o * torch.tensor(do, dtype=torch.float32)).sum() + (final * torch.tensor(dfinal, dtype=torch.float32)).sum()
     ).backward()
    tol = gdp_tolerance(dims["tokens"], num_householder, dims["key_dim"])
    check_close("o", o, expected["o"], tol)
    check_close("final_state", final, expected["final"], tol)
    for name, leaf in zip(NAMES, leaves):
        check_close(f"d{name}", leaf.grad, expected[f"d{name}"], tol)
    check_close("dinitial_state", init.grad, expected["dinitial"], tol)


def test_one_device_matches_numpy_chunked_reference_at_scale_argument():
    """An explicit scale and no initial state: compare with cp_linear.reference (numpy float64)."""
    arrays = gdp_arrays(3, tokens=45, num_householder=2, key_dim=9, value_dim=4)
    cu = cu_from_lengths([20, 1, 24])
    o_ref, final_ref = ref.naive_gated_delta_product(*arrays, scale=0.3, num_householder=2, cu_seqlens=cu)
    o, final = gated_delta_product(*to_torch(arrays), scale=0.3, num_householder=2, cu_seqlens=torch.tensor(cu))
    check_close("o", o, o_ref, gdp_tolerance(45, 2, 9))
    check_close("final_state", final, final_ref, gdp_tolerance(45, 2, 9))


@pytest.mark.parametrize("lengths", [pytest.param([20, 1, 24], id="packed"), pytest.param(None, id="rows-B2")])
def test_one_device_methods_give_the_ops_results(lengths):
    """TorchGDPBackend.one_device_forward / one_device_backward (the benchmarks' and GPU tests'
    reference) are the four functions with no neighbours, as the op runs them."""
    arrays = gdp_arrays(9, batch=1 if lengths else 2, tokens=45, num_householder=2)
    cu = None if lengths is None else torch.tensor(cu_from_lengths(lengths))
    rng = np.random.default_rng(10)
    initial = torch.tensor(rng.normal(size=(3 if lengths else 2, 2, 8, 6)), dtype=torch.float32)
    do = torch.tensor(rng.normal(size=(1 if lengths else 2, 45, 2, 6)), dtype=torch.float32)
    backend = TorchGDPBackend(16)
    leaves = [x.requires_grad_() for x in to_torch(arrays)] + [initial.clone().requires_grad_()]
    o, final = gated_delta_product(*leaves[:5], num_householder=2, cu_seqlens=cu, initial_state=leaves[5],
                                   backend=backend)
    ((o * do).sum() + final.square().sum()).backward()
    inputs = GDPInputs(*to_torch(arrays), 8 ** -0.5, 2, False, cu)
    o_method, final_method, saved = backend.one_device_forward(inputs, initial)
    grads, initial_grad = backend.one_device_backward(do, 2 * final_method, saved)
    assert torch.equal(o_method, o.detach()) and torch.equal(final_method, final.detach())
    for name, ours, theirs in zip(NAMES + ("initial",), (*grads[:5], initial_grad), (x.grad for x in leaves)):
        assert torch.equal(ours, theirs), name


def test_no_gate_is_a_zero_gate_as_in_flash_linear_attention():
    arrays = gdp_arrays(14, tokens=30, num_householder=2)
    cu = torch.tensor(cu_from_lengths([12, 18]))
    zero_gate = list(to_torch(arrays))
    zero_gate[3] = torch.zeros_like(zero_gate[3])
    o_ref, final_ref = gated_delta_product(*zero_gate, num_householder=2, cu_seqlens=cu)
    q, k, v, _, beta = (x.requires_grad_() for x in to_torch(arrays))
    o, final = gated_delta_product(q, k, v, None, beta, num_householder=2, cu_seqlens=cu)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)
    (o.sum() + final.sum()).backward()
    assert all(x.grad is not None for x in (q, k, v, beta))


def test_empty_sequences_end_in_their_initial_state_and_change_nothing_else():
    """cu_seqlens with empty sequences (as flash-linear-attention's varlen tests use): an empty
    sequence's final state is its initial state, and its final-state gradient flows to it."""
    arrays = gdp_arrays(15, tokens=30, num_householder=2)
    rng = np.random.default_rng(16)
    initial = rng.normal(size=(5, 2, 8, 6))
    dfinal = rng.normal(size=(5, 2, 8, 6))
    with_empty = cu_from_lengths([0, 12, 0, 18, 0])  # sequences 0, 2 and 4 are empty
    expected = oracle(arrays, num_householder=2, cu_seqlens=with_empty, initial_state=initial,
                      final_state_grad=dfinal, output_grad=np.ones((1, 30, 2, 6)))
    leaves = [x.requires_grad_() for x in to_torch(arrays)]
    init = torch.tensor(initial, dtype=torch.float32, requires_grad=True)
    o, final = gated_delta_product(*leaves, num_householder=2, cu_seqlens=torch.tensor(with_empty), initial_state=init,
                                   backend=TorchGDPBackend(8))
    (o.sum() + (final * torch.tensor(dfinal, dtype=torch.float32)).sum()).backward()
    empty = [0, 2, 4]
    assert torch.equal(final[empty], init.detach()[empty])  # exactly: no step touches them
    assert torch.equal(init.grad[empty], torch.tensor(dfinal, dtype=torch.float32)[empty])
    tol = gdp_tolerance(30, 2, 8)
    check_close("o", o, expected["o"], tol)
    check_close("final_state", final, expected["final"], tol)
    check_close("dinitial_state", init.grad, expected["dinitial"], tol)
    for name, leaf in zip(NAMES, leaves):
        check_close(f"d{name}", leaf.grad, expected[f"d{name}"], tol)


def test_final_state_alone_backpropagates_through_every_input():
    arrays = gdp_arrays(4, tokens=40, num_householder=2)
    cu = cu_from_lengths([25, 15])
    dfinal = np.random.default_rng(5).normal(size=(2, 2, 8, 6))
    expected = oracle(arrays, num_householder=2, cu_seqlens=cu, final_state_grad=dfinal)
    leaves = [x.requires_grad_() for x in to_torch(arrays)]
    _, final = gated_delta_product(*leaves, num_householder=2, cu_seqlens=torch.tensor(cu),
                                   backend=TorchGDPBackend(16))
    (final * torch.tensor(dfinal, dtype=torch.float32)).sum().backward()
    for name, leaf in zip(NAMES, leaves):
        check_close(f"d{name}", leaf.grad, expected[f"d{name}"], gdp_tolerance(40, 2, 8))


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_half_precision_inputs_return_their_dtype_and_match_float64_on_rounded_inputs(dtype):
    arrays = gdp_arrays(11, tokens=50, heads=2, key_dim=16, value_dim=12, num_householder=2)
    leaves = [x.requires_grad_() for x in to_torch(arrays, dtype)]
    rounded = [x.detach().double().numpy() for x in leaves]
    cu = cu_from_lengths([30, 1, 19])
    do = np.random.default_rng(12).normal(size=(1, 50, 2, 12))
    expected = oracle(rounded, num_householder=2, cu_seqlens=cu, output_grad=torch.tensor(do).to(dtype).double())
    o, final = gated_delta_product(*leaves, num_householder=2, cu_seqlens=torch.tensor(cu))
    assert o.dtype == dtype and final.dtype == torch.float32
    (o.float() * torch.tensor(do).to(dtype).float()).sum().backward()
    tol = gdp_tolerance(50, 2, 16, dtype)
    check_close("o", o, expected["o"], tol)
    check_close("final_state", final, expected["final"], gdp_tolerance(50, 2, 16))
    for name, leaf in zip(NAMES, leaves):
        assert leaf.grad.dtype == dtype
        check_close(f"d{name}", leaf.grad, expected[f"d{name}"], tol)


def test_outputs_and_gradients_are_bitwise_identical_run_to_run():
    arrays = gdp_arrays(13, tokens=90, heads=2, key_dim=16, value_dim=8, num_householder=2, l2norm=True)
    cu = torch.tensor(cu_from_lengths([40, 1, 49]))
    do = torch.randn(1, 90, 2, 8, generator=torch.Generator().manual_seed(0))

    def run():
        leaves = [x.requires_grad_() for x in to_torch(arrays)]
        o, final = gated_delta_product(*leaves, num_householder=2, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        ((o * do).sum() + final.sum()).backward()
        return [o.detach(), final.detach()] + [leaf.grad for leaf in leaves]

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# --------------------------------------------------------------------------- the CP protocol, by hand


def shard_inputs(arrays, rank, local_len, num_householder, *, cu=None, scale=None, l2norm=False, dtype=torch.float32):
    q, k, v, g, beta = to_torch(arrays, dtype)
    tok = slice(rank * local_len, (rank + 1) * local_len)
    step = slice(rank * local_len * num_householder, (rank + 1) * local_len * num_householder)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return GDPInputs(q[:, tok].contiguous(), k[:, step].contiguous(), v[:, step].contiguous(), g[:, tok].contiguous(),
                     beta[:, step].contiguous(), scale, num_householder, l2norm,
                     None if cu is None else torch.tensor(cu, dtype=torch.int32))


@pytest.mark.parametrize("lengths, rows, num_householder, l2norm", [
    pytest.param([48], None, 1, False, id="one-document-spans-three-shards"),
    pytest.param([20, 1, 3, 24], None, 2, True, id="documents-cross-and-end-inside-shards-l2norm"),
    pytest.param([16, 16, 16], None, 3, False, id="documents-end-on-shard-boundaries"),
    pytest.param(None, 2, 2, False, id="B2-rows"),
])
def test_forward_summaries_match_reference_shard_summary(lengths, rows, num_householder, l2norm):
    batch = rows or 1
    arrays = gdp_arrays(21, batch=batch, tokens=48, num_householder=num_householder, l2norm=l2norm)
    backend = TorchGDPBackend(8)
    for rank in range(3):
        cu = None
        if lengths is not None:
            cu = build_packed_sequence_cp_metadata(seq_idx_from_lengths(lengths), rank, 3).local_cu_seqlens
        inputs = shard_inputs(arrays, rank, 16, num_householder, cu=cu, l2norm=l2norm)
        summary, _ = backend.cp_forward_prepare(inputs)
        assert isinstance(summary, CPForwardPackedSummary) and summary.packed.dtype == torch.float32
        expected = ref.shard_forward_summary(inputs.k, inputs.v, inputs.g, inputs.beta, num_householder=num_householder,
                                             cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm, chunk_size=5)
        assert summary.packed.shape == expected.shape
        value_dim = inputs.v.shape[-1]
        tol = gdp_tolerance(16, num_householder, 8)
        check_close(f"rank {rank} E", summary.packed[..., :value_dim], expected[..., :value_dim], tol)
        check_close(f"rank {rank} M", summary.packed[..., value_dim:], expected[..., value_dim:], tol)


def test_backward_summary_is_the_gradient_wrt_the_incoming_state_and_M_transposed():
    arrays = gdp_arrays(22, tokens=40, num_householder=2)
    cu = cu_from_lengths([40])
    rng = np.random.default_rng(23)
    incoming = rng.normal(size=(2, 8, 6))
    do = rng.normal(size=(1, 40, 2, 6))
    backend = TorchGDPBackend(16)
    inputs = shard_inputs(arrays, 0, 40, 2, cu=cu)
    summary, local = backend.cp_forward_prepare(inputs)
    preceding = torch.cat([torch.tensor(incoming, dtype=torch.float32), torch.zeros(2, 8, 8)], -1)[None]
    output, saved = backend.cp_forward_apply(local, CPForwardPackedSummary(preceding))
    backward_summary, _ = backend.cp_backward_prepare(torch.tensor(do, dtype=torch.float32), saved)
    assert isinstance(backward_summary, CPBackwardPackedSummary)
    expected = oracle(arrays, num_householder=2, cu_seqlens=cu, initial_state=incoming[None], output_grad=do)
    check_close("o", output, expected["o"], gdp_tolerance(40, 2, 8))
    check_close("gamma", backward_summary.packed[..., :6], expected["dinitial"][0], gdp_tolerance(40, 2, 8))
    assert torch.equal(backward_summary.packed[..., 6:], summary.packed[..., 6:].transpose(-1, -2))


@pytest.mark.parametrize("lengths, rows, num_householder, l2norm", [
    pytest.param([5, 30, 1, 12], None, 2, True, id="packed-nh2-l2norm"),
    pytest.param([48], None, 3, False, id="packed-one-document-nh3"),
    pytest.param([1] * 20 + [28], None, 1, False, id="packed-many-documents-on-a-shard"),
    pytest.param(None, 2, 2, False, id="B2-rows-nh2"),
])
def test_protocol_driven_by_hand_over_three_shards_matches_float64(lengths, rows, num_householder, l2norm):
    """The frontend's job done in one process: prepare, stack, slice, apply, in both directions."""
    cp, local_len, batch = 3, 16, rows or 1
    arrays = gdp_arrays(31, batch=batch, tokens=cp * local_len, num_householder=num_householder, l2norm=l2norm)
    do = np.random.default_rng(32).normal(size=(batch, cp * local_len, 2, 6))
    cu_global = None if lengths is None else cu_from_lengths(lengths)
    expected = oracle(arrays, num_householder=num_householder, cu_seqlens=cu_global, l2norm=l2norm, output_grad=do)
    backend = TorchGDPBackend(8)
    metas = [None if lengths is None else build_packed_sequence_cp_metadata(seq_idx_from_lengths(lengths), r, cp)
             for r in range(cp)]
    prepared = [backend.cp_forward_prepare(shard_inputs(arrays, r, local_len, num_householder, l2norm=l2norm,
                                                        cu=None if m is None else m.local_cu_seqlens))
                for r, m in enumerate(metas)]
    stacked = torch.stack([summary.packed for summary, _ in prepared])
    starts = [0 if m is None else m.preceding_rank_start for m in metas]
    stops = [cp if m is None else m.following_rank_stop for m in metas]
    results = [backend.cp_forward_apply(local, CPForwardPackedSummary(stacked[starts[r]:r]))
               for r, (_, local) in enumerate(prepared)]
    tok = lambda r: slice(r * local_len, (r + 1) * local_len)  # noqa: E731
    step = lambda r: slice(r * local_len * num_householder, (r + 1) * local_len * num_householder)  # noqa: E731
    backward = [backend.cp_backward_prepare(torch.tensor(do[:, tok(r)], dtype=torch.float32), res.saved_context)
                for r, res in enumerate(results)]
    stacked = torch.stack([summary.packed for summary, _ in backward])
    grads = [backend.cp_backward_apply(ctx, CPBackwardPackedSummary(stacked[r + 1:stops[r]]))
             for r, (_, ctx) in enumerate(backward)]
    tol = gdp_tolerance(cp * local_len, num_householder, 8)
    for r in range(cp):
        check_close(f"rank {r} o", results[r].output, expected["o"][:, tok(r)], tol)
        for name in NAMES:
            sl = tok(r) if name in ("q", "g") else step(r)
            check_close(f"rank {r} d{name}", getattr(grads[r], f"d{name}"), expected[f"d{name}"][:, sl], tol)


# --------------------------------------------------------------------------- bad input


def _valid_call_args():
    arrays = to_torch(gdp_arrays(41, tokens=8, num_householder=2))
    return dict(zip(NAMES, arrays)), dict(num_householder=2)


@pytest.mark.parametrize("change, match", [
    pytest.param(lambda t, kw: t.update(k=torch.zeros(1, 15, 2, 8)), "k must have shape", id="k-steps-mismatch"),
    pytest.param(lambda t, kw: t.update(q=torch.zeros(1, 8, 2, 257), k=torch.zeros(1, 16, 2, 257)), "K = 257",
                 id="key-dim-over-256"),
    pytest.param(lambda t, kw: t.update(v=t["v"].double()), "float32, bfloat16 or float16", id="float64-input"),
    pytest.param(lambda t, kw: t.update(q=t["q"].half()), "share one dtype", id="q-k-dtype-mismatch"),
    pytest.param(lambda t, kw: kw.update(cu_seqlens=torch.tensor([0, 5, 3, 8])), "nondecreasing",
                 id="cu-seqlens-decreasing"),
    pytest.param(lambda t, kw: kw.update(cu_seqlens=torch.tensor([0, 5, 7])), "from 0 to T = 8",
                 id="cu-seqlens-short-of-T"),
    pytest.param(lambda t, kw: kw.update(cu_seqlens=torch.tensor([0.0, 8.0])), "int32 or int64",
                 id="cu-seqlens-float"),
    pytest.param(lambda t, kw: kw.update(initial_state=torch.zeros(2, 2, 8, 6)), r"initial_state must be",
                 id="initial-state-wrong-count"),
    pytest.param(lambda t, kw: kw.update(num_householder=3), "k must have shape", id="num-householder-mismatch"),
    pytest.param(lambda t, kw: kw.update(backend=object()), "cp_forward_prepare", id="backend-without-protocol"),
])
def test_gated_delta_product_rejects_bad_input(change, match):
    tensors, kwargs = _valid_call_args()
    change(tensors, kwargs)
    with pytest.raises(ValueError, match=match):
        gated_delta_product(*(tensors[name] for name in NAMES), **kwargs)


def test_cu_seqlens_needs_a_packed_batch():
    arrays = to_torch(gdp_arrays(42, batch=2, tokens=8))
    with pytest.raises(ValueError, match="B = 1"):
        gated_delta_product(*arrays, cu_seqlens=torch.tensor([0, 8]))


# --------------------------------------------------------------------------- CUDA (skipped without a GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_cuda_matches_float64_and_is_bitwise_repeatable(dtype):
    arrays = gdp_arrays(51, tokens=200, heads=2, key_dim=60, value_dim=100, num_householder=2, l2norm=True)
    cu = cu_from_lengths([1, 90, 1, 108])
    do = np.random.default_rng(52).normal(size=(1, 200, 2, 100))
    rounded = [x.double().numpy() for x in to_torch(arrays, dtype)]
    do_cast = torch.tensor(do).to(dtype)
    expected = oracle(rounded, num_householder=2, cu_seqlens=cu, l2norm=True, output_grad=do_cast.double(),
                      final_state_grad=np.ones((4, 2, 60, 100)))

    def run():
        leaves = [x.cuda().requires_grad_() for x in to_torch(arrays, dtype)]
        o, final = gated_delta_product(*leaves, num_householder=2, cu_seqlens=torch.tensor(cu).cuda(),
                                       use_qk_l2norm_in_kernel=True)
        ((o.float() * do_cast.cuda().float()).sum() + final.sum()).backward()
        return [o.detach(), final.detach()] + [leaf.grad for leaf in leaves]

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    for name, got in zip(("o", "final") + tuple(f"d{n}" for n in NAMES), first):
        stored = torch.float32 if name == "final" else dtype
        check_close(name, got.cpu(), expected[name], gdp_tolerance(200, 2, 60, stored))


def test_autocast_does_not_round_the_float32_state_math():
    arrays = to_torch(gdp_arrays(61, tokens=70, heads=2, key_dim=16, value_dim=12, num_householder=2), torch.bfloat16)
    cu = torch.tensor(cu_from_lengths([30, 40]))
    plain, _ = gated_delta_product(*arrays, num_householder=2, cu_seqlens=cu)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        leaves = [x.clone().requires_grad_() for x in arrays]
        under_autocast, final = gated_delta_product(*leaves, num_householder=2, cu_seqlens=cu)
    assert final.dtype == torch.float32
    assert torch.equal(plain, under_autocast)
    under_autocast.float().sum().backward()
    assert all(leaf.grad is not None and leaf.grad.dtype == torch.bfloat16 for leaf in leaves)
