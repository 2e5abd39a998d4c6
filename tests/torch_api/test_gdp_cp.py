"""gdp_chunkwise_context_parallel over real gloo process groups (world sizes 1-4).

Each rank runs its shard through the public op with autograd; the test process compares every
rank's output and five input gradients with the float64 recurrence (autograd oracle) and with the
one-device ``gated_delta_product`` on the whole sequence. Many cases run inside one pool task.
"""

import itertools
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cp_linear import build_packed_sequence_cp_metadata
from cp_linear.summary import CPBackwardUnpackedSummary, CPForwardPackedSummary, CPForwardUnpackedSummary, unpack
from tests.cp_linear.gdp_cases import seq_idx_from_lengths
from tests.tolerance import gdp_length, rel_err, tolerance
from tests.torch_api.test_gdp_chunk import (
    NAMES,
    check_close,
    cu_from_lengths,
    gdp_arrays,
    gdp_tolerance,
    oracle,
    to_torch,
)
from torch_api.gdp.chunk import TorchGDPBackend
from torch_api.gdp.cp import gdp_chunkwise_context_parallel
from torch_api.gdp.ops import gated_delta_product

LOCAL_LEN = 12
HEADS, KEY_DIM, VALUE_DIM = 2, 8, 6

pytestmark = pytest.mark.multirank


# --------------------------------------------------------------------------- cases


def packed_layouts(world):
    """Document lengths (summing to world * LOCAL_LEN) for the situations issue 3 §4 names."""
    total, L = world * LOCAL_LEN, LOCAL_LEN
    return {
        "document-spans-every-rank": [2, total - 4, 2] if world > 1 else [total],
        "documents-end-on-rank-boundaries": [L] * world if world > 1 else [5, 7],
        "one-token-documents-at-a-boundary": [L - 1, 1, 1, total - L - 1] if world > 1 else [1, L - 2, 1],
        "many-documents-on-a-rank": [3, 1, 2, 1, 1, 2, 1, total - 11],
    }


def cases_for(world):
    """Every layout, plus B = 2 rows, cycling through n_h in {1, 2, 3} x qk-l2norm and chunk sizes 8 / 64."""
    flavours = itertools.cycle([(1, False, 64), (2, True, 8), (3, False, 8), (1, True, 8), (2, False, 64),
                                (3, True, 64)])
    cases = [dict(name=name, lengths=lengths, batch=1) for name, lengths in packed_layouts(world).items()]
    cases += [dict(name="B2-rows", lengths=None, batch=2), dict(name="B1-rows-long-chunks", lengths=None, batch=1)]
    for seed, (case, (n_h, l2norm, chunk)) in enumerate(zip(cases, flavours)):
        case.update(seed=100 * world + seed, num_householder=n_h, l2norm=l2norm, chunk_size=chunk)
    return cases


def case_arrays(case, world):
    return gdp_arrays(case["seed"], batch=case["batch"], tokens=world * LOCAL_LEN, heads=HEADS, key_dim=KEY_DIM,
                      value_dim=VALUE_DIM, num_householder=case["num_householder"], l2norm=case["l2norm"])


def case_output_grad(case, world):
    rng = np.random.default_rng(case["seed"] + 1)
    return rng.normal(size=(case["batch"], world * LOCAL_LEN, HEADS, VALUE_DIM))


def local_slices(rank, n_h):
    tok = slice(rank * LOCAL_LEN, (rank + 1) * LOCAL_LEN)
    return tok, slice(tok.start * n_h, tok.stop * n_h)


def run_rank_case(rank, world, case, *, cp_group=None, backend=None, check_inputs=True, dtype=torch.float32):
    """This rank's output and input gradients (numpy) for one case, through the public op."""
    n = case["num_householder"]
    tok, step = local_slices(rank, n)
    arrays = to_torch(case_arrays(case, world), dtype)
    leaves = [x[:, tok if name in ("q", "g") else step].contiguous().requires_grad_()
              for name, x in zip(NAMES, arrays)]
    metadata = None
    if case["lengths"] is not None:
        metadata = build_packed_sequence_cp_metadata(seq_idx_from_lengths(case["lengths"]), rank, world)
    backend = TorchGDPBackend(case["chunk_size"]) if backend is None else backend
    output = gdp_chunkwise_context_parallel(*leaves, cp_group=dist.group.WORLD if cp_group is None else cp_group,
                                            metadata=metadata, num_householder=n,
                                            use_qk_l2norm_in_kernel=case["l2norm"], backend=backend,
                                            check_inputs=check_inputs)
    do = torch.tensor(case_output_grad(case, world)[:, tok], dtype=dtype)
    (output.float() * do.float()).sum().backward()
    result = {"o": output.detach()}
    result.update({f"d{name}": leaf.grad for name, leaf in zip(NAMES, leaves)})
    return result


def run_cases(rank, world, cases, use_mesh=False):
    group = None
    if use_mesh:
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh("cpu", (world,))
    return [{key: t.numpy() for key, t in run_rank_case(rank, world, case, cp_group=group).items()}
            for case in cases]


def expected_for(case, world):
    arrays = case_arrays(case, world)
    cu = None if case["lengths"] is None else cu_from_lengths(case["lengths"])
    do = case_output_grad(case, world)
    float64 = oracle(arrays, num_householder=case["num_householder"], cu_seqlens=cu, l2norm=case["l2norm"],
                     output_grad=do)
    leaves = [x.requires_grad_() for x in to_torch(arrays)]
    o, _ = gated_delta_product(*leaves, num_householder=case["num_householder"],
                               cu_seqlens=None if cu is None else torch.tensor(cu),
                               use_qk_l2norm_in_kernel=case["l2norm"])
    (o * torch.tensor(do, dtype=torch.float32)).sum().backward()
    one_device = {"o": o.detach().numpy()}
    one_device.update({f"d{name}": leaf.grad.numpy() for name, leaf in zip(NAMES, leaves)})
    return float64, one_device


def check_every_rank(results, case, world):
    float64, one_device = expected_for(case, world)
    n = case["num_householder"]
    length = gdp_length(world * LOCAL_LEN, n, KEY_DIM)
    references = (("float64", float64, tolerance(length)),  # the one-device op carries float32 rounding too
                  ("one-device", one_device, tolerance(length, compared_with="rounded")))
    for rank, got in enumerate(results):
        tok, step = local_slices(rank, n)
        for reference_name, expected, tol in references:
            label = f"{case['name']} rank {rank} vs {reference_name}"
            check_close(f"{label} o", got["o"], expected["o"][:, tok], tol)
            for name in NAMES:
                sl = tok if name in ("q", "g") else step
                check_close(f"{label} d{name}", got[f"d{name}"], expected[f"d{name}"][:, sl], tol)


# --------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_rank_matches_float64_and_one_device_outputs_and_gradients(gloo_pools, world):
    cases = cases_for(world)
    per_rank = gloo_pools(world).run(run_cases, cases)
    for index, case in enumerate(cases):
        check_every_rank([per_rank[rank][index] for rank in range(world)], case, world)


def test_cp_group_may_be_a_1d_device_mesh(gloo_pools):
    cases = [cases_for(2)[1]]
    per_rank = gloo_pools(2).run(run_cases, cases, use_mesh=True)
    check_every_rank([per_rank[rank][0] for rank in range(2)], cases[0], 2)


class UnpackedSummaryBackend(TorchGDPBackend):
    """Returns its summaries unpacked (two tensors each), to exercise the coalesced all-gather pair."""

    def cp_forward_prepare(self, inputs):
        summary, local = super().cp_forward_prepare(inputs)
        parts = unpack(summary)
        return CPForwardUnpackedSummary(parts.transition.contiguous(), parts.state_update.contiguous()), local

    def cp_forward_apply(self, local_context, preceding):
        assert isinstance(preceding, CPForwardUnpackedSummary)
        return super().cp_forward_apply(local_context, preceding)

    def cp_backward_prepare(self, output_grad, saved_context):
        summary, context = super().cp_backward_prepare(output_grad, saved_context)
        parts = unpack(summary)
        return CPBackwardUnpackedSummary(parts.transition.contiguous(), parts.local_state_grad.contiguous()), context

    def cp_backward_apply(self, backward_context, following):
        assert isinstance(following, CPBackwardUnpackedSummary)
        return super().cp_backward_apply(backward_context, following)


def run_without_gate(rank, world, lengths):
    """The op with g=None and with global_seq_idx (instead of metadata) against g = 0 with metadata."""
    arrays = to_torch(gdp_arrays(77, tokens=world * LOCAL_LEN, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM))
    tok = slice(rank * LOCAL_LEN, (rank + 1) * LOCAL_LEN)
    q, k, v, g, beta = (x[:, tok].contiguous() for x in arrays)
    ids = seq_idx_from_lengths(lengths)
    metadata = build_packed_sequence_cp_metadata(ids, rank, world)
    zero = gdp_chunkwise_context_parallel(q, k, v, torch.zeros_like(g), beta, cp_group=dist.group.WORLD,
                                          metadata=metadata)
    without = gdp_chunkwise_context_parallel(q, k, v, None, beta, cp_group=dist.group.WORLD, global_seq_idx=ids)
    return bool(torch.equal(zero, without))


def test_no_gate_and_global_seq_idx_give_the_zero_gate_with_metadata(gloo_pools):
    assert all(gloo_pools(2).run(run_without_gate, [5, 14, 5]))


def run_packed_and_unpacked_twice(rank, world, case):
    packed = [run_rank_case(rank, world, case) for _ in range(2)]
    unpacked = run_rank_case(rank, world, case, backend=UnpackedSummaryBackend(case["chunk_size"]))
    keys = packed[0].keys()
    return {
        "bitwise_repeatable": all(torch.equal(packed[0][key], packed[1][key]) for key in keys),
        "unpacked_rel_diff": max(rel_err(unpacked[key].detach().numpy(), packed[0][key].detach().numpy())
                                 for key in keys),
    }


def test_results_are_bitwise_repeatable_and_unpacked_summaries_give_the_same_answer(gloo_pools):
    case = cases_for(3)[0]
    tol = tolerance(gdp_length(3 * LOCAL_LEN, case["num_householder"], KEY_DIM), compared_with="rounded")
    for result in gloo_pools(3).run(run_packed_and_unpacked_twice, case):
        assert result["bitwise_repeatable"]
        assert result["unpacked_rel_diff"] <= tol


def run_half_precision(rank, world, case, dtype):
    out = run_rank_case(rank, world, case, dtype=dtype)
    return {key: (str(t.dtype), t.float().numpy()) for key, t in out.items()}


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_half_precision_shards_keep_their_dtype_and_match_float64(gloo_pools, dtype):
    world, case = 2, cases_for(2)[0]
    tol = gdp_tolerance(world * LOCAL_LEN, case["num_householder"], KEY_DIM, dtype)
    results = gloo_pools(world).run(run_half_precision, case, dtype)
    rounded = [x.double().numpy() for x in to_torch(case_arrays(case, world), dtype)]
    do = torch.tensor(case_output_grad(case, world)).to(dtype).double().numpy()
    expected = oracle(rounded, num_householder=case["num_householder"], cu_seqlens=cu_from_lengths(case["lengths"]),
                      l2norm=case["l2norm"], output_grad=do)
    for rank, got in enumerate(results):
        tok, step = local_slices(rank, case["num_householder"])
        for key, (dtype_name, value) in got.items():
            assert dtype_name == str(dtype), key
            sl = tok if key in ("o", "dq", "dg") else step
            check_close(f"rank {rank} {key}", value, expected[key][:, sl], tol)


# --------------------------------------------------------------------------- bad input, on every rank


class Float64SummaryBackend(TorchGDPBackend):
    def cp_forward_prepare(self, inputs):
        summary, local = super().cp_forward_prepare(inputs)
        return CPForwardPackedSummary(summary.packed.double()), local


class FailsOnRankOneBackend(TorchGDPBackend):
    def cp_forward_prepare(self, inputs):
        if dist.get_rank() == 1:
            raise RuntimeError("out of scratch memory")
        return super().cp_forward_prepare(inputs)


def _bad_call(rank, world, scenario):
    n = 2
    case = dict(name=scenario, lengths=[5, world * LOCAL_LEN - 5], batch=1, seed=7, num_householder=n,
                l2norm=False, chunk_size=8)
    tok, step = local_slices(rank, n)
    arrays = to_torch(case_arrays(case, world))
    q, k, v, g, beta = (x[:, tok if i in (0, 3) else step].contiguous() for i, x in enumerate(arrays))
    ids = seq_idx_from_lengths(case["lengths"])
    metadata = build_packed_sequence_cp_metadata(ids, rank, world)
    kwargs = dict(cp_group=dist.group.WORLD, metadata=metadata, num_householder=n)
    if scenario == "local-length-disagrees-with-metadata" and rank == 1:
        q, g, k, v, beta = q[:, :-1], g[:, :-1], k[:, :-n], v[:, :-n], beta[:, :-n]
    elif scenario == "metadata-for-another-cp-size" and rank == 0:
        kwargs["metadata"] = build_packed_sequence_cp_metadata(ids, 0, 1)
    elif scenario == "metadata-for-another-rank" and rank == 1:
        kwargs["metadata"] = build_packed_sequence_cp_metadata(ids, 0, world)
    elif scenario == "rows-shapes-disagree-across-ranks":
        kwargs["metadata"] = None
        if rank == 1:
            q, g, k, v, beta = q[:, :-1], g[:, :-1], k[:, :-n], v[:, :-n], beta[:, :-n]
    elif scenario == "key-dim-over-256":
        q, k = torch.zeros(*q.shape[:3], 300), torch.zeros(*k.shape[:3], 300)
    elif scenario == "nan-in-g-on-rank-1" and rank == 1:
        g = g.clone()
        g[0, 3, 1] = float("nan")
    elif scenario == "inf-in-v-on-last-rank" and rank == world - 1:
        v = v.clone()
        v[0, 0, 0, 0] = float("inf")
    elif scenario == "non-float32-summary":
        kwargs["backend"] = Float64SummaryBackend()
    elif scenario == "backend-fails-on-rank-1":
        kwargs["backend"] = FailsOnRankOneBackend()
    output = gdp_chunkwise_context_parallel(q.requires_grad_(), k, v, g, beta, **kwargs)
    do = torch.ones_like(output)
    if scenario == "nan-in-output-grad-on-rank-0" and rank == 0:
        do[0, 0, 0, 0] = float("nan")
    output.backward(do)
    return output


BAD_SCENARIOS = [
    ("local-length-disagrees-with-metadata", r"rank 1: metadata describes a local length of 12 tokens; q holds 11"),
    ("metadata-for-another-cp-size", r"rank 0: metadata was built for cp_rank 0 of cp_size 1"),
    ("metadata-for-another-rank", r"rank 1: metadata was built for cp_rank 0 of cp_size"),
    ("rows-shapes-disagree-across-ranks", r"disagree across ranks"),
    ("key-dim-over-256", r"K = 300 exceeds the supported maximum K = 256"),
    ("nan-in-g-on-rank-1", r"rejected on 1 rank\(s\) — rank 1: non-finite values \(NaN or Inf\) in g"),
    ("inf-in-v-on-last-rank", r"non-finite values \(NaN or Inf\) in v"),
    ("non-float32-summary", r"forward summary must be float32; received torch.float64"),
    ("backend-fails-on-rank-1", r"rank 1: FailsOnRankOneBackend.cp_forward_prepare raised RuntimeError: out of scratch"),
    ("nan-in-output-grad-on-rank-0", r"backward rejected on 1 rank\(s\) — rank 0: non-finite .* in output_grad"),
]


def run_bad_scenarios(rank, world):
    messages = []
    for scenario, _ in BAD_SCENARIOS:
        try:
            _bad_call(rank, world, scenario)
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    return messages


@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_raises_the_same_value_error_on_every_rank_before_any_collective(gloo_pools, world):
    per_rank = gloo_pools(world).run(run_bad_scenarios)
    for index, (scenario, pattern) in enumerate(BAD_SCENARIOS):
        messages = {per_rank[rank][index] for rank in range(world)}
        assert len(messages) == 1, f"{scenario}: ranks raised different errors {messages}"
        message = messages.pop()
        assert re.search(pattern, message), f"{scenario}: {message!r} does not match {pattern!r}"


def count_agreements_without_checks(rank, world):
    import torch_api.gdp.cp as cp_module

    calls = []
    original = cp_module.agree_or_raise

    def counting(*args, **kwargs):
        calls.append(kwargs.get("value_flags") is not None)
        return original(*args, **kwargs)

    cp_module.agree_or_raise = counting
    try:
        case = cases_for(world)[0]
        checked = run_rank_case(rank, world, case)
        with_checks = list(calls)
        unchecked = run_rank_case(rank, world, case, check_inputs=False)
        without_checks = calls[len(with_checks):]
    finally:
        cp_module.agree_or_raise = original
    same = all(torch.equal(checked[key], unchecked[key]) for key in checked)
    return with_checks, without_checks, same


def test_check_inputs_false_keeps_the_agreement_header_drops_the_value_checks_and_changes_nothing_else(gloo_pools):
    # the header travels per direction whatever the flag (ranks with different flags must meet in it)
    for with_checks, without_checks, same in gloo_pools(2).run(count_agreements_without_checks):
        assert (with_checks, without_checks, same) == ([True, True], [False, False], True)


def run_under_autocast(rank, world, case):
    plain = run_rank_case(rank, world, case, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = run_rank_case(rank, world, case, dtype=torch.bfloat16)
    return all(torch.equal(plain[key], autocast[key]) for key in plain)


def test_cp_under_autocast_keeps_float32_summaries_and_matches_plain_bf16(gloo_pools):
    assert gloo_pools(2).run(run_under_autocast, cases_for(2)[0]) == [True, True]
