"""The CuTeDSL backend's host path (work layout, launches, folds, CP prepare/apply) on the CPU.

Every kernel launch is carried out by ``cp_linear.kernels.emulation`` (the same algorithm in
torch, rounding where the kernels round), so this checks everything around the kernels, and the
blocked algorithm's precision, against the float64 reference without a GPU. The GPU tests
(``test_cutedsl_backend.py``) check the kernels against the same emulation.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import torch_api.gdp.cutedsl as cutedsl
from cp_linear.kernels import launch as kl
from cp_linear.kernels import configs as kcfg
from cp_linear.kernels.emulation import run_emulated
from cp_linear.reference import naive_gated_delta_product
from cp_linear.summary import compose_backward, compose_forward
from tests.cp_linear.gdp_cases import rel_err
from tests.cutedsl_inputs import emulation_inputs as _inputs
from tests.cutedsl_inputs import INFERENCE_LENGTHS, inference_case, recorded_scan_modes
from tests.torch_api.cp_shards import CP_BACKWARD_CASES, case_inputs, cp_forward_backward, float64_reference
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


@pytest.mark.parametrize("with_initial", [False, True], ids=["zero-start", "initial-state"])
def test_one_device_rows_forward_matches_float64(emulated, with_initial):
    """Rows (no cu_seqlens): each row is a sequence with its own start and final state (the final
    states are read from every row's last segment, and the layout comes from the rows cache)."""
    n_h, heads, dim, rows, tokens = 2, 2, 64, 3, 150
    q, k, v, g, beta = _inputs([tokens], heads, dim, dim, n_h, seed=12, rows=rows)
    initial = None
    if with_initial:
        initial = torch.randn(rows, heads, dim, dim, generator=torch.Generator().manual_seed(13)) * 0.3
    inputs = GDPInputs(q, k, v, g, beta, scale=dim ** -0.5, num_householder=n_h, use_qk_l2norm_in_kernel=True)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2)
    for _ in range(2):  # the layout built, then taken from the cache
        o, final, _ = backend.one_device_forward(inputs, initial)
        for row in range(rows):
            one = slice(row, row + 1)
            o_ref, final_ref = _reference(q[one], k[one], v[one], g[one], beta[one], n_h, None,
                                          None if initial is None else initial[one])
            assert rel_err(o[one].float().numpy(), o_ref) < OUTPUT_LIMIT
            assert rel_err(final[one].numpy(), final_ref) < STATE_LIMIT


def _two_shards(q, k, v, g, beta, n_h, cu_local):
    """Rank 0's and rank 1's GDPInputs: the first and the second half of the tokens (and of their n_h steps),
    with the ranks' local cu_seqlens (or None for rows)."""
    half = q.shape[1] // 2
    shards = []
    for rank in range(2):
        tok = slice(rank * half, (rank + 1) * half)
        step = slice(rank * half * n_h, (rank + 1) * half * n_h)
        shards.append(GDPInputs(q[:, tok], k[:, step], v[:, step], g[:, tok], beta[:, step], scale=q.shape[-1] ** -0.5,
                                num_householder=n_h, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_local[rank]))
    return shards


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
    prepared = [backend.cp_forward_prepare(shard) for shard in _two_shards(q, k, v, g, beta, n_h, cu_local)]
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
    ref = _float64_gradients(q, k, v, g, beta, do, dfinal, initial, lengths, n_h)
    for name, leaf, expected in zip(("q", "k", "v", "g", "beta", "initial"), leaves, ref):
        got = leaf.grad.float().reshape(expected.shape).numpy()
        assert rel_err(got, expected.numpy()) < GRAD_LIMIT, name


@pytest.mark.parametrize("containment", ["torch-ops", "token-checks-kernel"])
def test_contained_kernel_backward_is_zero_at_poisoned_inputs_and_clean_elsewhere(emulated, monkeypatch, containment):
    """check_inputs=False through the kernels (bf16, qk l2norm): a NaN in k and an Inf in q and g. The
    gradients are finite, exactly zero at every input of a poisoned (token, head), bad entries included
    (sanitising passes the gradient through), and elsewhere those of the clean inputs with no gradient
    through the poisoned outputs (tests/faults/cases.py::contained_gdp_gradients). The flags and sanitised
    copies come from the torch ops, or the flags alone from the token-checks kernel, the contained kernels
    zeroing the flagged rows (``isolation.contained_inputs``)."""
    from tests.faults.cases import contained_gdp_gradients, expected_gdp_poison
    from torch_api import gated_delta_product
    from torch_api.gdp import validation

    launched = []
    if containment == "token-checks-kernel":
        monkeypatch.setattr(validation, "_kernel_platform_ready", lambda device: True)
    monkeypatch.setattr(kl._Launch, "run", lambda launch: (launched.append(type(launch)), run_emulated(launch)))

    lengths, n_h = [70, 90], 2
    clean = list(_inputs(lengths, heads=2, key_dim=64, value_dim=64, n_h=n_h, seed=31))
    dirty = [x.clone() for x in clean]
    dirty[1][0, 20 * n_h, 1, 3] = float("nan")  # k, token 20 (sequence 0), head 1
    dirty[0][0, 100, 0, 7] = float("inf")  # q, token 100 (sequence 1), head 0: poisons token 100 alone
    dirty[3][0, 130, 0] = float("inf")  # g, token 130 (sequence 1), head 0
    state_poisoned = np.stack([expected_gdp_poison(lengths, [130], 160), expected_gdp_poison(lengths, [20], 160)],
                              axis=1)  # [T, H]
    poisoned = state_poisoned.copy()
    poisoned[100, 0] = True
    final_bad = np.array([[False, True], [True, False]])  # [sequence, head]
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2, backward="kernels")

    def run(leaves, check_inputs):
        return gated_delta_product(*leaves, num_householder=n_h, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                   backend=backend, check_inputs=check_inputs)

    out, _ = run(dirty, False)
    assert np.array_equal(~torch.isfinite(out[0]).all(-1).numpy(), poisoned)
    assert out.is_contiguous()  # else the backward copies the output gradient back (cutedsl._flat)
    assert launched.count(kl.TokenChecksLaunch) == (containment == "token-checks-kernel")
    dirty_grads, clean_grads, zero = contained_gdp_gradients(run, clean, dirty, poisoned, state_poisoned,
                                                             final_bad, n_h)
    for name, mine, reference, must_be_zero in zip(("q", "k", "v", "g", "beta"), dirty_grads, clean_grads, zero):
        assert torch.isfinite(mine).all(), name
        assert not mine[0][must_be_zero].any(), name
        assert rel_err(mine.float().numpy(), reference.float().numpy()) < 1e-3, name


def _float64_gradients(q, k, v, g, beta, do, dfinal, initial, lengths, n_h):
    """float64 reference gradients (q, k, v, g, beta, initial state) of the same (rounded) inputs, sequence
    by sequence: [T, H, ...] each, the initial state's [N, H, K, V]."""
    from cp_linear.kernels import backward_algorithm as ba

    starts = np.cumsum([0] + lengths)
    reference = [[] for _ in range(6)]
    for n, (t0, t1) in enumerate(zip(starts[:-1], starts[1:])):
        parts = [x[0].double() for x in (q[:, t0:t1], k[:, t0 * n_h:t1 * n_h], v[:, t0 * n_h:t1 * n_h],
                                         g[:, t0:t1], beta[:, t0 * n_h:t1 * n_h])]
        got = ba.sequence_backward(*parts, do[0, t0:t1].double(), dfinal[n].double(), num_householder=n_h,
                                   scale=q.shape[-1] ** -0.5, use_l2=True, initial_state=initial[n].double())
        for slot, grad in enumerate(got):
            reference[slot].append(grad)
    return [torch.cat(parts[:], 0) for parts in reference[:5]] + [torch.stack(reference[5])]


def test_backward_summaries_take_the_forward_transitions_transposed(emulated):
    """The backward summary's transition rows M_b are the forward summary's transition rows transposed
    (rows dX = dS^T evolve by the transposed chunk maps, in reverse order). Segments the forward
    summarised (FORWARD_TRANSITION_FLAG) copy them, transposed, from the forward summaries the saved buffer
    keeps (every row of a segment without a summary zero); the others (sequence 0's last segment here) come
    from chunk_gamma. Both agree with chunk_gamma computing every row, to bf16 operand rounding, and not
    with its transpose; and the same backward on saved transitions transposed misses the float64
    gradients (what a wrong orientation would do)."""
    from dataclasses import replace

    lengths, n_h, heads, dim, segment_chunks = [150, 37, 301], 2, 2, 64, 2
    q, k, v, g, beta = _inputs(lengths, heads=heads, key_dim=dim, value_dim=dim, n_h=n_h, seed=61)
    g = g * 0.05  # a slow decay: the gradient reaching a segment through the following ones matters
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    gen = torch.Generator().manual_seed(62)
    initial = torch.randn(len(lengths), heads, dim, dim, generator=gen) * 0.1
    do = torch.randn(1, sum(lengths), heads, dim, generator=gen).bfloat16()
    dfinal = torch.randn(len(lengths), heads, dim, dim, generator=gen)  # the last segments' transitions matter
    inputs = GDPInputs(q, k, v, g, beta, scale=dim ** -0.5, num_householder=n_h, use_qk_l2norm_in_kernel=True,
                       cu_seqlens=cu)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=segment_chunks, backward="kernels")
    _, _, saved = backend.one_device_forward(inputs, initial)
    regions = backend._saved_regions(inputs)
    forward_summaries = cutedsl._carve(cutedsl.kernel_saved_of(saved), regions)["summaries"]
    max_segments = dict((name, shape) for name, _, shape in regions)["states"][0]
    assert forward_summaries.shape == (max_segments, heads, 2 * dim, dim)  # + S_max x H x (V + K) x K x 4 bytes
    transitions = forward_summaries[:, :, dim:]  # M^T rows

    _, context = backend.cp_backward_prepare((do, dfinal), saved)
    layout = context.shard.layout
    count = int(layout.num_segments[0])
    flags = layout.seg_grad_flags[:count]
    # segments 0-2: sequence 0 (the leading one: all summarised, the last by chunk_gamma); 3: the 37-token
    # sequence (its only segment: no backward summary); 4-8: the trailing sequence (the forward summarised all)
    assert flags.tolist() == [3, 3, 1, 0, 0, 3, 3, 3, 3]
    unsummarised = [segment for segment in range(max_segments) if segment >= count or not layout.seg_flags[segment]]
    assert len(unsummarised) > 1 and torch.count_nonzero(forward_summaries[unsummarised]) == 0
    every_row = torch.full_like(context.grad_summaries, float("nan"))
    backend._gamma(replace(context.shard, layout=replace(layout, seg_grad_flags=layout.seg_grad_flags & 1)),
                   context.do, every_row, forward_summaries)  # (not read: no FORWARD_TRANSITION_FLAG left)
    got = context.grad_summaries
    for segment in range(count):
        if not flags[segment] & 1:
            continue
        assert torch.equal(got[segment, :, :dim], every_row[segment, :, :dim]), segment  # gamma rows
        computed = every_row[segment, :, dim:]
        if flags[segment] & kl.FORWARD_TRANSITION_FLAG:
            assert torch.equal(got[segment, :, dim:], transitions[segment].transpose(-1, -2)), segment
            assert rel_err(got[segment, :, dim:].numpy(), computed.numpy()) < 1e-2, segment  # measured 3.5e-3
            assert rel_err(got[segment, :, dim:].transpose(-1, -2).numpy(), computed.numpy()) > 0.1, segment
        else:
            assert torch.equal(got[segment, :, dim:], computed), segment

    reference = _float64_gradients(q, k, v, g, beta, do, dfinal, initial, lengths, n_h)
    errors = {}
    for orientation in ("saved", "transposed"):
        if orientation == "transposed":
            transitions.copy_(transitions.transpose(-1, -2).clone())
        grads, d_initial = backend.one_device_backward(do, dfinal, saved)
        errors[orientation] = [rel_err(got.float().reshape(expected.shape).numpy(), expected.numpy())
                               for got, expected in zip([*grads[:5], d_initial], reference)]
    assert max(errors["saved"]) < GRAD_LIMIT, errors["saved"]
    assert max(errors["transposed"]) > 10 * GRAD_LIMIT, errors["transposed"]


def test_saved_and_recomputed_prep_and_chunk_states_give_identical_gradients(emulated):
    """save_prep (the forward's Ta, Tb, P and scalars ride in the saved buffer, or the backward reruns
    chunk_prep) and save_chunk_states (the output pass writes every chunk's start state, mode
    "output_states", or the backward reruns the scan in mode "states") give bitwise-equal gradients;
    the saved buffer is larger by exactly what each keeps, and the backward never rebuilds the layout
    from cu_seqlens."""
    from torch_api import gated_delta_product
    from torch_api.gdp.types import GDPInputs

    lengths, heads, dim, n_h = [150, 37, 301], 2, 64, 2
    q, k, v, g, beta = _inputs(lengths, heads=heads, key_dim=dim, value_dim=dim, n_h=n_h, seed=31)
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    do = torch.randn(1, sum(lengths), heads, dim, generator=torch.Generator().manual_seed(6)).bfloat16()
    grads, words, modes = {}, {}, {}
    variants = [(True, True), (False, True), (True, False)]  # (save_prep, save_chunk_states)
    for variant in variants:
        save_prep, save_chunk_states = variant
        backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2, backward="kernels", save_prep=save_prep,
                                                            save_chunk_states=save_chunk_states)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
        with recorded_scan_modes() as modes[variant]:
            o, _ = gated_delta_product(*leaves, num_householder=n_h, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                       backend=backend)
            real_layout = kl.forward_layout
            kl.forward_layout = None  # the backward must take the saved tables
            try:
                o.backward(do)
            finally:
                kl.forward_layout = real_layout
        grads[variant] = [leaf.grad for leaf in leaves]
        inputs = GDPInputs(q, k, v, g, beta, dim ** -0.5, n_h, True, cu)
        words[variant] = backend.saved_buffer_shape(inputs)[0]
    for variant in variants[1:]:
        for name, kept, other in zip(("q", "k", "v", "g", "beta"), grads[variants[0]], grads[variant]):
            assert torch.equal(kept, other), (variant, name)
    assert modes[(True, True)] == ["summary", "output_states"]
    assert modes[(True, False)] == ["summary", "output", "states"]
    chunks = sum(lengths) // 32 + len(lengths)  # C_max at n_h = 2 (32 tokens per chunk)
    prep_bytes = chunks * heads * (2 * 64 * 64 * 2 + 32 * 64 * 2 + 4 * 64 * 4)
    assert (words[(True, True)] - words[(False, True)]) * 4 == prep_bytes
    assert (words[(True, True)] - words[(True, False)]) * 4 == chunks * heads * dim * dim * 2


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
    prepared = [backend.cp_forward_prepare(shard) for shard in _two_shards(q, k, v, g, beta, n_h, cu_local)]
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


@pytest.mark.parametrize("layout", ["packed", "rows"])
def test_kernel_cp_backward_apply_repeats_exactly(emulated, layout):
    """apply refolds the trailing sequence's rows of prepare's fold in place (packed) when following
    summaries arrive: a second apply with them, and an apply without them afterwards, give bit for bit
    what a fresh context gives (the latter: prepare's fold restored)."""
    n_h, heads, dim = 2, 2, 64
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2, backward="kernels")
    rows = 2 if layout == "rows" else 1
    lengths = [60, 150, 46] if layout == "packed" else [256]
    q, k, v, g, beta = _inputs(lengths, heads, dim, dim, n_h, seed=16, rows=rows)
    cu_local = [None, None] if layout == "rows" else [torch.tensor([0, 60, 128], dtype=torch.int32),
                                                       torch.tensor([0, 82, 128], dtype=torch.int32)]
    do = torch.randn(rows, sum(lengths), heads, dim, generator=torch.Generator().manual_seed(17)).bfloat16()
    prepared = [backend.cp_forward_prepare(shard) for shard in _two_shards(q, k, v, g, beta, n_h, cu_local)]
    saved = [backend.cp_forward_apply(prepared[0][1], None).saved_context,
             backend.cp_forward_apply(prepared[1][1], prepared[0][0].packed[None]).saved_context]
    half = q.shape[1] // 2
    following = backend.cp_backward_prepare(do[:, half:], saved[1])[0].packed[None]

    def context():
        return backend.cp_backward_prepare(do[:, :half], saved[0])[1]

    reused = context()
    first = backend.cp_backward_apply(reused, following)
    without = backend.cp_backward_apply(reused, None)
    second = backend.cp_backward_apply(reused, following)
    for name, a, b, c, d in zip(first._fields, first, second, without, backend.cp_backward_apply(context(), None)):
        if a is None:
            continue
        assert torch.equal(a, b) and torch.equal(c, d), name
    assert not torch.equal(first.dk, without.dk)  # the following summaries mattered (dq does not read them)


# float32 operands through the emulation: nothing rounds to bf16, so the composed step meets float64 at
# float32 accumulation (measured 2-5e-7 over CP_BACKWARD_CASES); a missing or misordered summary moves
# every affected output or gradient by ~0.15 (cp_shards.case_inputs' slow decay), and bf16 operands alone
# would cost ~3.5e-3. 1e-5 leaves 20x headroom over float32 reassociation and nothing more.
FLOAT32_CP_LIMIT = 1e-5


@pytest.mark.parametrize("case", CP_BACKWARD_CASES, ids=lambda case: case.id)
def test_kernel_cp_backward_over_shards_matches_float64(emulated, monkeypatch, case):
    """W ranks' CP forward and backward composed on one device (``cp_shards``: the plan's shards, every
    prepare, the gathered summaries sliced per rank as ``torch_api.gdp.cp`` slices them, every apply)
    against the float64 reference of the whole packed problem. The emulation takes float32 operands
    here (the kernels themselves take bf16 / fp16 only), so the tolerance checks the composition and
    not bf16 rounding."""
    monkeypatch.setitem(cutedsl.KERNEL_DTYPE_NAMES, torch.float32, "float32")
    monkeypatch.setattr(kcfg, "TENSOR_CORE_DTYPES", kcfg.TENSOR_CORE_DTYPES + ("float32",))
    q, k, v, g, beta, do = case_inputs(case, dtype=torch.float32, device="cpu", seed=case.cp_size)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2, backward="kernels")
    options = dict(num_householder=case.num_householder, l2norm=case.l2norm)
    got = cp_forward_backward(backend, q, k, v, g, beta, do, case.lengths, case.cp_size, **options)
    expected = float64_reference(q, k, v, g, beta, do, case.lengths, **options)
    for name, mine, want in zip(got._fields, got, expected):
        assert mine.dtype == torch.float32 and mine.shape == want.shape, name
        assert rel_err(mine.numpy(), want.numpy()) < FLOAT32_CP_LIMIT, name


# the bf16 budget, which the GPU test (test_cutedsl_backend.py) holds the kernels to; the
# emulation measures 2.6-3.8e-3 on these inputs
BF16_CP_BUDGET = {"output": 5e-3, "dq": 5e-3, "dk": 5e-3, "dv": 5e-3, "dg": 1e-2, "dbeta": 5e-3}


@pytest.mark.parametrize("case", CP_BACKWARD_CASES, ids=lambda case: case.id)
def test_kernel_cp_backward_over_shards_meets_the_bf16_budget(emulated, case):
    """The GPU test's composition and inputs (same seeds) on the emulation: the blocked algorithm with
    bf16 operands fits the budget the kernels are held to, so a GPU failure points at the kernels."""
    q, k, v, g, beta, do = case_inputs(case, dtype=torch.bfloat16, device="cpu", seed=40 + case.cp_size)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2, backward="kernels")
    options = dict(num_householder=case.num_householder, l2norm=case.l2norm)
    got = cp_forward_backward(backend, q, k, v, g, beta, do, case.lengths, case.cp_size, **options)
    expected = float64_reference(q, k, v, g, beta, do, case.lengths, **options)
    for name, mine, want in zip(got._fields, got, expected):
        assert rel_err(mine.float().numpy(), want.numpy()) <= BF16_CP_BUDGET[name], name


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


# ---------------------------------------------------------------------------------------------- fold dedup
# The forward folds once (prepare, every sequence from [0 ; I]: each segment's prefix map) and apply
# turns the prefix maps into incoming states in one parallel step (segment_fold mode "apply_affine").
# The saved segment states must still be each segment's incoming state, and unused rows zero.


def _prefix_state(q, k, v, g, beta, n_h, row, start, stop, initial=None):
    """float64 state [H, K, V] of the sequence of batch row ``row`` that starts at token ``start``,
    after its tokens [start, stop) (``initial`` [H, K, V] at ``start``; zero when None)."""
    heads, dim_k, dim_v = q.shape[2], q.shape[3], v.shape[3]
    if stop == start:
        return np.zeros((heads, dim_k, dim_v)) if initial is None else initial.double().numpy()
    tok, step = slice(start, stop), slice(start * n_h, stop * n_h)
    _, final = _reference(q[row:row + 1, tok], k[row:row + 1, step], v[row:row + 1, step], g[row:row + 1, tok],
                          beta[row:row + 1, step], n_h, None, None if initial is None else initial[None])
    return final[0]


def _check_segment_states(states, q, k, v, g, beta, n_h, segment_tokens, pieces):
    """``states`` [S_max, H, V, K]: the saved segment states of one shard. ``pieces``: the shard's
    sequences in order, as (row, global start of the sequence, global first token of the piece in
    this shard, tokens of the piece, initial state or None). Each segment's state must be the
    float64 state at its first token, and the rows after the last segment zero."""
    segment = 0
    for row, seq_start, piece_start, piece_tokens, initial in pieces:
        for offset in range(0, piece_tokens, segment_tokens):
            expected = _prefix_state(q, k, v, g, beta, n_h, row, seq_start, piece_start + offset, initial)
            got = states[segment].transpose(-1, -2).numpy()  # saved rows are S^T
            assert rel_err(got, expected) < STATE_LIMIT or np.abs(expected).max() == 0 == np.abs(got).max(), segment
            segment += 1
    assert torch.count_nonzero(states[segment:]) == 0


@pytest.mark.parametrize("case", ["one_sequence", "one_sequence_initial", "packed_initial"])
def test_one_device_forward_and_saved_segment_states(emulated, case):
    """(a) one sequence, no initial state; (b) one sequence from an initial state; packed sequences,
    each from its own initial state: outputs and final states against float64 and TorchGDPBackend,
    and every saved segment state against the float64 state at the segment's first token."""
    from torch_api.gdp.chunk import TorchGDPBackend

    n_h, heads, dim, segment_chunks = 2, 2, 64, 2
    lengths = [300] if case.startswith("one") else [150, 37, 301]
    q, k, v, g, beta = _inputs(lengths, heads, dim, dim, n_h, seed=41)
    g = g * 0.05  # a slow decay, so that the initial state still matters in later segments
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    initial = None
    if case != "one_sequence":
        initial = torch.randn(len(lengths), heads, dim, dim, generator=torch.Generator().manual_seed(42)) * 0.3
    inputs = GDPInputs(q, k, v, g, beta, scale=dim ** -0.5, num_householder=n_h, use_qk_l2norm_in_kernel=True,
                       cu_seqlens=cu)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=segment_chunks, backward="kernels")
    o, final, saved = backend.one_device_forward(inputs, initial)
    o_ref, final_ref = _reference(q, k, v, g, beta, n_h, cu.numpy(), initial)
    assert rel_err(o.float().numpy(), o_ref) < OUTPUT_LIMIT
    assert rel_err(final.numpy(), final_ref) < STATE_LIMIT
    o_torch, final_torch, _ = TorchGDPBackend().one_device_forward(inputs, initial)
    assert rel_err(o.float().numpy(), o_torch.float().numpy().astype(np.float64)) < OUTPUT_LIMIT
    assert rel_err(final.numpy(), final_torch.numpy().astype(np.float64)) < STATE_LIMIT
    states = backend.saved_segment_states(saved)
    assert states is not None and states.shape[2:] == (dim, dim)
    segment_tokens = segment_chunks * (64 // n_h)
    starts = np.cumsum([0] + lengths)
    pieces = [(0, int(starts[n]), int(starts[n]), lengths[n], None if initial is None else initial[n])
              for n in range(len(lengths))]
    _check_segment_states(states, q, k, v, g, beta, n_h, segment_tokens, pieces)


@pytest.mark.parametrize("layout", ["spanning", "packed", "rows"])
def test_cp_apply_saved_segment_states_continue_from_the_preceding_summaries(emulated, layout):
    """(c) CP over two shards: rank 1's leading sequence (every row in rows mode) starts from the
    fold of rank 0's summary; every saved segment state of both ranks is the float64 state at the
    segment's first token (the leading sequence's through E_pre + S_in M_pre)."""
    n_h, heads, dim, segment_chunks = 2, 2, 64, 2
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=segment_chunks, backward="kernels")
    half = 128
    if layout == "rows":
        q, k, v, g, beta = _inputs([2 * half], heads, dim, dim, n_h, seed=43, rows=2)
        cu_local = [None, None]
        pieces = [[(row, 0, 0, half, None) for row in range(2)], [(row, 0, half, half, None) for row in range(2)]]
    else:
        lengths = [2 * half] if layout == "spanning" else [60, 150, 46]
        q, k, v, g, beta = _inputs(lengths, heads, dim, dim, n_h, seed=44)
        if layout == "spanning":
            cu_local = [torch.tensor([0, half], dtype=torch.int32)] * 2
            pieces = [[(0, 0, 0, half, None)], [(0, 0, half, half, None)]]
        else:  # [60, 68] | [82, 46]: the 150-token sequence spans the ranks
            cu_local = [torch.tensor([0, 60, 128], dtype=torch.int32), torch.tensor([0, 82, 128], dtype=torch.int32)]
            pieces = [[(0, 0, 0, 60, None), (0, 60, 60, 68, None)], [(0, 60, 128, 82, None), (0, 210, 210, 46, None)]]
    g = g * 0.05  # the preceding state still matters on rank 1
    prepared = [backend.cp_forward_prepare(shard) for shard in _two_shards(q, k, v, g, beta, n_h, cu_local)]
    results = [backend.cp_forward_apply(prepared[0][1], None),
               backend.cp_forward_apply(prepared[1][1], prepared[0][0].packed[None])]
    segment_tokens = segment_chunks * (64 // n_h)
    for rank in range(2):
        states = backend.saved_segment_states(results[rank].saved_context)
        _check_segment_states(states, q, k, v, g, beta, n_h, segment_tokens, pieces[rank])


@pytest.mark.parametrize("init_count", [0, 1, 4])
def test_apply_affine_emulation_equals_the_sequential_fold(emulated, init_count):
    """The emulation of segment_fold mode "apply_affine" on prepare's prefix maps gives the sequential
    fold's incoming states (sequences below ``init_count`` from their init rows, the others from
    zero; an empty sequence in between), and zero rows for the unused segments."""
    from tests.cutedsl_inputs import fold_both_ways, fold_summaries

    heads, dim = 2, 64
    summaries, starts = fold_summaries([3, 0, 5, 1], 2, heads, dim, dim, seed=51)
    init = torch.randn(4, heads, dim, dim, generator=torch.Generator().manual_seed(52))
    sequential, via_prefix, _ = fold_both_ways(summaries, starts, init, init_count, dim)
    real = int(starts[-1])
    assert rel_err(via_prefix[:real].numpy(), sequential[:real].numpy().astype(np.float64)) < 1e-5
    assert torch.count_nonzero(via_prefix[real:]) == 0


def test_prefix_fold_writes_only_the_trailing_sequences_final_rows(emulated):
    """FINAL_TRAILING writes only the trailing sequences' final rows (``check_trailing_final_rows``)."""
    from tests.cutedsl_inputs import check_trailing_final_rows

    check_trailing_final_rows("cpu")


def test_fold_shortcuts_match_the_plain_fold(emulated):
    """FINAL_LEADING, ADD_TRAILING, ADD_EVERY and ``transition_count`` (``check_fold_modes``)."""
    from tests.cutedsl_inputs import check_fold_modes

    check_fold_modes("cpu")


# --------------------------------------------------------------------------- inference: the lean one-device plan


def _poisoned_emulation(launches: list):
    """``_Launch.run`` on the emulation, recording every launch and filling each float output with NaN
    first: a later read of anything a launch does not write shows up in the results (as the JAX
    emulation's result buffers, and uninitialised memory on the GPU). The output pass's final states are
    poisoned only in the rows of sequences with segments: an empty sequence's row is the caller's fill."""
    def run(launch):
        launches.append(launch)
        for name in type(launch).OUTPUTS:
            output = getattr(launch, name)
            if not output.is_floating_point():
                continue
            if isinstance(launch, kl.ChunkScanLaunch) and name == "state_out" and launch.config.mode in \
                    kcfg.OUTPUT_MODES:
                bounds = launch.seq_first_segment
                output[bounds[1:] > bounds[:-1]] = float("nan")
            else:
                output.fill_(float("nan"))
        run_emulated(launch)
    return run


def _plan(launches) -> list[str]:
    """Each launch as "kernel" or "kernel:mode"."""
    names = []
    for launch in launches:
        mode = getattr(launch.config, "mode", None)
        names.append(type(launch).__name__ + (f":{mode}" if mode else ""))
    return names


@pytest.mark.parametrize("layout", ["packed", "rows"])
@pytest.mark.parametrize("with_initial", [False, True], ids=["zero-start", "initial-state"])
@pytest.mark.parametrize("n_h", [1, 2])
def test_inference_forward_matches_float64_and_the_saving_forward(emulated, monkeypatch, layout, with_initial, n_h):
    """``one_device_forward`` with ``save_for_backward=False`` (the lean plan: no CP summary, no prefix
    maps, no apply_affine) against float64 and against the forward that saves for the kernel backward:
    bitwise without initial states (apply_affine adds nothing to E_pre then), within float32 rounding
    of the incoming states with them. Every output is poisoned before its launch writes it."""
    inputs, initial = inference_case(layout, n_h, with_initial, seed=60 + n_h)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2, backward="kernels")
    launches = []
    monkeypatch.setattr(kl._Launch, "run", _poisoned_emulation(launches))
    o, final, saved = backend.one_device_forward(replace(inputs, save_for_backward=False), initial)
    assert saved is None
    assert not torch.isnan(o.float()).any() and not torch.isnan(final).any()
    o_saving, final_saving, saved_saving = backend.one_device_forward(inputs, initial)
    assert backend.saved_segment_states(saved_saving) is not None  # the saving forward's plan, unchanged
    q, k, v, g, beta = inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta
    if layout == "rows":
        for row in range(q.shape[0]):
            one = slice(row, row + 1)
            o_ref, final_ref = _reference(q[one], k[one], v[one], g[one], beta[one], n_h, None,
                                          None if initial is None else initial[one])
            assert rel_err(o[one].float().numpy(), o_ref) < OUTPUT_LIMIT
            assert rel_err(final[one].numpy(), final_ref) < STATE_LIMIT
    else:
        o_ref, final_ref = _reference(q, k, v, g, beta, n_h, inputs.cu_seqlens.numpy(), initial)
        assert rel_err(o.float().numpy(), o_ref) < OUTPUT_LIMIT
        assert rel_err(final.numpy(), final_ref) < STATE_LIMIT
        if initial is not None:  # the empty sequences keep their initial states
            for n in np.flatnonzero(np.array(INFERENCE_LENGTHS) == 0):
                assert torch.equal(final[n], initial[n])
    if initial is None:
        assert torch.equal(o, o_saving) and torch.equal(final, final_saving)
    else:
        # measured: o 6e-5 (a few bf16 roundings of the chunk states flip), final states 1e-7
        assert rel_err(o.float().numpy(), o_saving.float().numpy().astype(np.float64)) < 5e-4
        assert rel_err(final.numpy(), final_saving.numpy().astype(np.float64)) < 1e-6


@pytest.mark.parametrize("layout", ["packed", "one-sequence", "rows"])
@pytest.mark.parametrize("with_initial", [False, True], ids=["zero-start", "initial-state"])
def test_inference_forward_runs_the_lean_plan(emulated, monkeypatch, layout, with_initial):
    """Four launches (the saving forward runs five): chunk_prep, the summary pass of only the segments
    followed by another one in their sequence, one fold of V rows from each sequence's start (its
    initial state, or zero rows: no identity rows) writing no final rows, the output pass without chunk
    states. The saving forward's plan is unchanged."""
    inputs, initial = inference_case("rows" if layout == "rows" else "packed", 2, with_initial, seed=70)
    if layout == "one-sequence":
        tokens = 300
        inputs = replace(inputs, q=inputs.q[:, :tokens], k=inputs.k[:, :2 * tokens], v=inputs.v[:, :2 * tokens],
                         g=inputs.g[:, :tokens], beta=inputs.beta[:, :2 * tokens],
                         cu_seqlens=torch.tensor([0, tokens], dtype=torch.int32))
        initial = None if initial is None else initial[:1]
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2, backward="kernels")
    launches = []
    monkeypatch.setattr(kl._Launch, "run", _poisoned_emulation(launches))
    backend.one_device_forward(replace(inputs, save_for_backward=False), initial)
    # a packed shard's tables come from one layout launch; a rows layout's are cached host tables
    layout_launches = [] if layout == "rows" else ["ForwardLayoutLaunch"]
    assert _plan(launches) == layout_launches + ["ChunkPrepLaunch", "ChunkScanLaunch:summary",
                                                 "SegmentFoldLaunch:fold", "ChunkScanLaunch:output"]
    _, summary, fold, output = launches[len(layout_launches):]
    layout_tables = fold.seq_first_segment
    real = int(layout_tables[-1])
    followed = torch.zeros(summary.seg_flags.shape[0], dtype=torch.int32)
    values_only = torch.zeros_like(followed)  # zero starts: a first segment's transition rows go unread
    for n in range(layout_tables.shape[0] - 1):
        followed[int(layout_tables[n]):max(int(layout_tables[n + 1]) - 1, int(layout_tables[n]))] = 1
        if initial is None and layout != "rows":
            values_only[int(layout_tables[n])] = followed[int(layout_tables[n])]
    assert torch.equal(summary.seg_flags & 1, followed) and real > int(followed.sum())
    assert torch.equal(summary.seg_flags >> 1, values_only) and (initial is not None or layout == "rows"
                                                               or int(values_only.sum()) > 0)
    assert (fold.incoming.shape[2], fold.value_rows, fold.identity_row) == (64, 64, 64)
    assert (fold.write_final, fold.descending, fold.add_mode) == (kl.FINAL_NONE, 0, kl.ADD_NONE)
    sequences = layout_tables.shape[0] - 1
    if initial is None:
        assert fold.init_count == 0
    else:
        assert fold.init_count == sequences and torch.equal(fold.init, initial.transpose(-1, -2))
    assert output.state_in is fold.incoming
    launches.clear()
    backend.one_device_forward(inputs, initial)
    assert _plan(launches) == layout_launches + ["ChunkPrepLaunch", "ChunkScanLaunch:summary",
                                                 "SegmentFoldLaunch:fold", "SegmentFoldLaunch:apply_affine",
                                                 "ChunkScanLaunch:output_states"]


def test_the_op_without_gradients_runs_the_lean_plan_and_with_them_the_saving_one(emulated, monkeypatch):
    """``torch_api.gated_delta_product`` hands a forward that no backward follows to the backend's
    ``one_device_forward`` (the lean plan) and keeps the protocol's plan when inputs require gradients;
    both give the same outputs and final states (zero start: bitwise)."""
    from torch_api import gated_delta_product

    inputs, _ = inference_case("packed", 2, False, seed=80)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2, backward="kernels")
    launches = []
    monkeypatch.setattr(kl._Launch, "run", _poisoned_emulation(launches))
    args = (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)
    options = dict(num_householder=2, cu_seqlens=inputs.cu_seqlens, use_qk_l2norm_in_kernel=True, backend=backend)
    o, final = gated_delta_product(*args, **options)
    assert _plan(launches) == ["ForwardLayoutLaunch", "ChunkPrepLaunch", "ChunkScanLaunch:summary",
                               "SegmentFoldLaunch:fold", "ChunkScanLaunch:output"]
    launches.clear()
    trained = [x.detach().clone().requires_grad_(True) for x in args]
    o_grad, final_grad = gated_delta_product(*trained, **options)
    assert "SegmentFoldLaunch:apply_affine" in _plan(launches)
    assert torch.equal(o, o_grad.detach()) and torch.equal(final, final_grad.detach())


@pytest.mark.parametrize("lead", [(1,), (3,)], ids=["packed", "rows"])
@pytest.mark.parametrize("count", [1, 3])
def test_row_form_summary_folds_match_the_array_api_folds(lead, count):
    """The backend's own folds of the neighbours' summaries (``_fold_preceding`` in the kernels' row form,
    ``_fold_following``) against ``cp_linear.summary``'s: equal to rounding, bitwise from a zero start of
    one summary, and NaN where a transition holds inf (M times the zero state is not skipped)."""
    heads, key_dim, value_dim = 2, 8, 4
    generator = torch.Generator().manual_seed(count)
    stacked = torch.randn(count, *lead, heads, key_dim, value_dim + key_dim, generator=generator) / key_dim ** 0.5
    start = torch.randn(*lead, heads, key_dim, value_dim, generator=generator)
    for start_state in (None, start):
        start_rows = None if start_state is None else start_state.transpose(-1, -2)
        rows = cutedsl._fold_preceding(stacked, start_rows)
        assert rows.shape == (*lead, heads, value_dim, key_dim) and rows.is_contiguous()
        expected = compose_forward(stacked, start_state).transpose(-1, -2)
        torch.testing.assert_close(rows, expected, rtol=1e-6, atol=1e-6)
        if count == 1 and start_state is None:
            assert torch.equal(rows, expected)
    gradient = cutedsl._fold_following(stacked)
    assert gradient.shape == (*lead, heads, key_dim, value_dim) and gradient.is_contiguous()
    torch.testing.assert_close(gradient, compose_backward(stacked), rtol=1e-6, atol=1e-6)
    if count == 1:
        assert torch.equal(gradient, compose_backward(stacked))
    # an inf in the transition each fold applies first, to its zero state: inf * 0 = NaN
    poisoned = stacked.clone()
    poisoned[0, ..., 1, 2, value_dim + 3] = float("inf")
    poisoned[-1, ..., 1, 2, value_dim + 3] = float("inf")
    rows = cutedsl._fold_preceding(poisoned, None)
    expected = compose_forward(poisoned).transpose(-1, -2)
    assert rows.isnan().any() and torch.equal(rows.isnan(), expected.isnan())
    gradient = cutedsl._fold_following(poisoned)
    assert gradient.isnan().any() and torch.equal(gradient.isnan(), compose_backward(poisoned).isnan())
