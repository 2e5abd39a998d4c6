"""Block-diagonal attention under CP on real gloo groups, against full-sequence references.

Outputs are checked against ``cp_linear.reference.blockdiag_attention`` (float64 numpy) and
gradients against autograd through ``torch_api.attention.naive`` over the full sequence (float64).
Each world size runs all of its cases inside one pool task (spawning ranks costs seconds).
"""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cp_linear import build_blockdiag_plan
from cp_linear.reference import blockdiag_attention as reference_blockdiag_attention
from tests.tolerance import assert_close, attention_length, tolerance
from torch_api.attention.naive import naive_blockdiag_attention

pytestmark = pytest.mark.multirank


@dataclass(frozen=True)
class Case:
    name: str
    doc_ids: tuple[int, ...]
    batch: int = 1
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 12
    seed: int = 0


def docs(*runs):
    """docs((1, 5), (0, 3), (2, 9)) -> five 1s, three 0s, nine 2s."""
    return tuple(doc for doc, length in runs for _ in range(length))


CASES = {
    2: [
        Case("document_straddles_two_ranks", docs((1, 6), (2, 12), (3, 8))),
        Case("documents_end_on_the_boundary", docs((1, 8), (2, 8)), q_heads=2, kv_heads=1),
    ],
    3: [
        Case("interior_padding_between_documents", docs((1, 5), (0, 3), (2, 9), (0, 2), (3, 6), (0, 4), (4, 4)),
             batch=2),
        Case("all_padding_middle_rank", docs((1, 5), (2, 3), (0, 8), (3, 6), (0, 2)), q_heads=2, kv_heads=1),
    ],
    4: [
        Case("single_document_over_all_ranks", docs((1, 28)), q_heads=2, kv_heads=1),
        Case("all_padding_first_rank_and_full_left_halo", docs((0, 6), (1, 9), (0, 3), (2, 6))),
        Case("document_ends_on_boundary_after_spanning_two_ranks", docs((1, 6), (2, 12), (3, 6)), head_dim=60),
        Case("document_spans_four_ranks", docs((1, 3), (2, 13), (3, 4)), batch=2, q_heads=6, kv_heads=2),
    ],
}


def full_inputs(case: Case):
    """float32 q, k, v, grad_out [B, T, H, D], the same on every rank."""
    gen = torch.Generator().manual_seed(case.seed)
    tokens = len(case.doc_ids)
    shapes = [(case.batch, tokens, case.q_heads, case.head_dim), (case.batch, tokens, case.kv_heads, case.head_dim),
              (case.batch, tokens, case.kv_heads, case.head_dim), (case.batch, tokens, case.q_heads, case.head_dim)]
    return [torch.randn(shape, generator=gen, dtype=torch.float64).float() for shape in shapes]


def modes_for(case: Case, world_size: int):
    plan = build_blockdiag_plan(np.array(case.doc_ids), world_size)
    return ["auto", "allgather", "a2a"] + (["halo"] if plan.use_halo else [])


def run_cases(rank, world_size, cases):
    """On every rank: each case in each mode, forward + backward; local results as numpy."""
    from torch_api import blockdiag_attention
    from torch_api.attention.blockdiag import prepare_blockdiag

    group = dist.group.WORLD
    results = []
    for case in cases:
        q, k, v, grad_out = full_inputs(case)
        local_len = len(case.doc_ids) // world_size
        local = slice(rank * local_len, (rank + 1) * local_len)
        doc_ids = torch.tensor(case.doc_ids)
        for mode in modes_for(case, world_size):
            q_l, k_l, v_l = (t[:, local].clone().requires_grad_() for t in (q, k, v))
            out = blockdiag_attention(q_l, k_l, v_l, doc_ids, cp_group=group, mode=mode)
            out.backward(grad_out[:, local])
            results.append({
                "case": case.name, "mode": mode, "used": prepare_blockdiag(doc_ids, group, mode).mode,
                "out": out.detach().numpy(),
                "grads": [None if t.grad is None else t.grad.numpy() for t in (q_l, k_l, v_l)],
            })
    return results


def full_sequence_references(case: Case):
    q, k, v, grad_out = full_inputs(case)
    ids = np.array(case.doc_ids)
    out = reference_blockdiag_attention(q.numpy(), k.numpy(), v.numpy(), ids)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    naive_blockdiag_attention(*leaves, torch.from_numpy(ids)).backward(grad_out.double())
    return out, [t.grad.numpy() for t in leaves]


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_every_mode_matches_full_sequence_attention(gloo_pools, world_size):
    cases = CASES[world_size]
    per_rank = gloo_pools(world_size).run(run_cases, cases)
    index = 0
    for case in cases:
        ref_out, ref_grads = full_sequence_references(case)
        padding = np.array(case.doc_ids) == 0
        plan = build_blockdiag_plan(np.array(case.doc_ids), world_size)
        tol = tolerance(attention_length(len(case.doc_ids), case.head_dim))
        for mode in modes_for(case, world_size):
            ranks = [results[index] for results in per_rank]
            index += 1
            assert all(r["case"] == case.name and r["mode"] == mode for r in ranks)
            label = f"{case.name} mode={mode}"
            expected_mode = ("halo" if plan.use_halo else "a2a") if mode == "auto" else mode
            assert {r["used"] for r in ranks} == {expected_mode}, label
            out = np.concatenate([r["out"] for r in ranks], axis=1)
            assert_close(label, ref_out, out, tol)
            assert np.all(out[:, padding] == 0), f"{label}: padding rows must be exactly 0"
            for which, ref_grad in zip("qkv", ref_grads):
                assert all(r["grads"]["qkv".index(which)] is not None for r in ranks), f"{label}: d{which} is None"
                grad = np.concatenate([r["grads"]["qkv".index(which)] for r in ranks], axis=1)
                assert_close(f"{label}: d{which}", ref_grad, grad, tol)
                assert np.all(grad[:, padding] == 0), f"{label}: d{which} on padding tokens must be exactly 0"


def test_auto_picks_a2a_when_one_document_spans_every_rank():
    plan = build_blockdiag_plan(np.array(docs((1, 28))), 4)
    assert not plan.use_halo and plan.back == (0, 7, 14, 21)


# --------------------------------------------------------------------------- errors


def attention_errors(rank, world_size, scenario):
    """Run one bad call on every rank; return the error text (or 'ok')."""
    from torch_api import blockdiag_attention

    tokens, head_dim, mode = 28, 12, "auto"
    doc_ids = docs((1, 28))
    if scenario == "forced_halo_impossible":
        mode = "halo"
    if scenario == "rank_specific_head_dim" and rank == 1:
        head_dim = 13
    if scenario == "rank_specific_doc_ids" and rank == 2:
        doc_ids = docs((1, 10), (2, 8), (1, 10))  # id 1 reappears: rejected by plan validation
    local_len = tokens // world_size
    q = torch.randn(1, local_len, 4, head_dim, requires_grad=True)
    k = torch.randn(1, local_len, 2, head_dim, requires_grad=True)
    v = torch.randn(1, local_len, 2, head_dim, requires_grad=True)
    doc_ids = torch.tensor(doc_ids)
    if scenario == "routing_prepared_for_another_mode":
        from torch_api.attention.blockdiag import prepare_blockdiag

        doc_ids, mode = prepare_blockdiag(doc_ids, dist.group.WORLD, "allgather"), "a2a"
    try:
        out = blockdiag_attention(q, k, v, doc_ids, cp_group=dist.group.WORLD, mode=mode)
        out.sum().backward()
    except ValueError as err:
        return str(err)
    return "ok"


@pytest.mark.parametrize(
    "scenario, expected",
    [
        pytest.param("forced_halo_impossible", "mode='halo' needs every document straddle", id="forced-halo"),
        pytest.param("rank_specific_head_dim", "disagree across ranks", id="rank-specific-D"),
        pytest.param("rank_specific_doc_ids", "rank 2: document id 1 occupies more than one", id="rank-specific-ids"),
        pytest.param("routing_prepared_for_another_mode", "differs from the routing's mode='allgather'",
                     id="routing-mode-mismatch"),
        pytest.param("fine", "ok", id="control"),
    ],
)
def test_bad_input_raises_the_same_error_on_every_rank(gloo_pools, scenario, expected):
    messages = gloo_pools(4).run(attention_errors, scenario)
    assert len(set(messages)) == 1, messages
    assert expected in messages[0]


def test_forced_halo_error_names_the_rank_that_reaches_too_far(gloo_pools):
    message = gloo_pools(4).run(attention_errors, "forced_halo_impossible")[0]
    assert "rank 3's first document starts 21 tokens before its shard" in message


# --------------------------------------------------------------------------- one agreement header per call


def count_agreements(rank, world_size):
    """Three 'layers' on one doc_ids tensor, then a new step: how many agreement collectives ran."""
    import torch_api.attention.blockdiag as blockdiag

    calls = []
    real_agree = blockdiag.agree_or_raise

    def counting_agree(*args, **kwargs):
        calls.append(1)
        return real_agree(*args, **kwargs)

    blockdiag.agree_or_raise = counting_agree
    try:
        counts = []
        for step in range(2):
            doc_ids = torch.tensor(docs((1, 5 + step), (2, 11 - step)))
            x = torch.randn(1, 16 // world_size, 2, 8, requires_grad=True)
            for _layer in range(3):
                x = blockdiag.blockdiag_attention(x, x[:, :, :1], x[:, :, 1:], doc_ids, cp_group=dist.group.WORLD)
            x.sum().backward()
            counts.append(len(calls))
        routing = blockdiag.prepare_blockdiag(doc_ids, dist.group.WORLD)
        for _layer in range(2):
            blockdiag.blockdiag_attention(x.detach(), x[:, :, :1].detach(), x[:, :, 1:].detach(), routing,
                                          cp_group=dist.group.WORLD)
        counts.append(len(calls))
        return counts
    finally:
        blockdiag.agree_or_raise = real_agree


def test_agreement_header_travels_once_per_forward_call_and_never_in_backward(gloo_pools):
    # A cached agreement let one rank skip it while another ran it (a rank that changed dtype or
    # mutated doc_ids hung every rank), so the fixed-size header travels on every forward call;
    # the backward's collectives follow the agreed forward and need none.
    assert gloo_pools(2).run(count_agreements) == [[3, 6, 8], [3, 6, 8]]
