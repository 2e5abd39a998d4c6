"""Initial and final sequence states under CP (``gdp_chunkwise_context_parallel(initial_state=...,
output_final_state=True)``) over real gloo groups, world 1-3.

Every rank runs its shard with a replicated initial state [N, H, K, V] and a loss on its output and on
its final state; the test compares outputs, final states and all gradients (d initial_state included)
with the float64 recurrence (autograd oracle) and with the one-device ``gated_delta_product`` on the
whole sequence. Final states and d initial_state are per rank rows (zeros where a sequence does not end /
start): their sum over ranks is the one-device value, and their zero rows are checked to be exact.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.cp_linear.gdp_cases import seq_idx_from_lengths
from tests.tolerance import gdp_length, tolerance
from tests.torch_api.test_gdp_chunk import NAMES, check_close, cu_from_lengths, gdp_arrays, oracle, to_torch
from torch_api.gdp.chunk import TorchGDPBackend
from torch_api.gdp.cp import gdp_chunkwise_context_parallel
from torch_api.gdp.ops import gated_delta_product

LOCAL_LEN = 10
HEADS, KEY_DIM, VALUE_DIM = 2, 8, 6

pytestmark = pytest.mark.multirank


def layouts(world):
    """Lengths summing to world * LOCAL_LEN (None: B = 2 batch rows, each one sequence over all ranks)."""
    total, L = world * LOCAL_LEN, LOCAL_LEN
    cases = {
        "one-sequence": [total],
        "short-sequences-around-boundaries": [L - 1, 1, 1, total - L - 1] if world > 1 else [1, L - 2, 1],
        "many-sequences-on-a-rank": [3, 1, 2, 1, 1, total - 8],
        "B2-rows": None,
    }
    if world >= 2:
        cases["sequences-end-on-rank-boundaries"] = [L] * world
    if world >= 3:  # the middle sequence starts on rank 0 and ends on rank 2
        cases["sequence-spans-three-ranks"] = [L - 3, L + 6, total - 2 * L - 3]
    return cases


def cases_for(world):
    flavours = [(1, False, 64), (2, True, 4), (3, False, 8), (1, True, 8), (2, False, 64), (3, True, 4)]
    cases = []
    for index, (name, lengths) in enumerate(layouts(world).items()):
        n_h, l2norm, chunk = flavours[index % len(flavours)]
        cases.append(dict(name=name, lengths=lengths, batch=1 if lengths else 2, seed=1000 * world + index,
                          num_householder=n_h, l2norm=l2norm, chunk_size=chunk))
    return cases


def case_data(case, world):
    """Inputs, initial state [N, H, K, V] and the cotangents of o and of the final state (numpy float64)."""
    arrays = gdp_arrays(case["seed"], batch=case["batch"], tokens=world * LOCAL_LEN, heads=HEADS, key_dim=KEY_DIM,
                        value_dim=VALUE_DIM, num_householder=case["num_householder"], l2norm=case["l2norm"])
    sequences = case["batch"] if case["lengths"] is None else len(case["lengths"])
    rng = np.random.default_rng(case["seed"] + 7)
    initial = rng.normal(size=(sequences, HEADS, KEY_DIM, VALUE_DIM))
    output_grad = rng.normal(size=(case["batch"], world * LOCAL_LEN, HEADS, VALUE_DIM))
    final_grad = rng.normal(size=initial.shape)
    return arrays, initial, output_grad, final_grad


def local_slices(rank, n_h):
    tok = slice(rank * LOCAL_LEN, (rank + 1) * LOCAL_LEN)
    return tok, slice(tok.start * n_h, tok.stop * n_h)


def run_rank_case(rank, world, case, summary_exchange="all_gather"):
    arrays, initial, output_grad, final_grad = case_data(case, world)
    tok, step = local_slices(rank, case["num_householder"])
    leaves = [x[:, tok if name in ("q", "g") else step].contiguous().requires_grad_()
              for name, x in zip(NAMES, to_torch(arrays))]
    initial_state = torch.tensor(initial, dtype=torch.float32, requires_grad=True)
    ids = None if case["lengths"] is None else seq_idx_from_lengths(case["lengths"])
    output, final = gdp_chunkwise_context_parallel(
        *leaves, cp_group=dist.group.WORLD, global_seq_idx=ids, num_householder=case["num_householder"],
        use_qk_l2norm_in_kernel=case["l2norm"], backend=TorchGDPBackend(case["chunk_size"]),
        initial_state=initial_state, output_final_state=True, summary_exchange=summary_exchange)
    loss = (output * torch.tensor(output_grad[:, tok], dtype=torch.float32)).sum()
    loss = loss + (final * torch.tensor(final_grad, dtype=torch.float32)).sum()
    loss.backward()
    result = {"o": output.detach().numpy(), "final": final.detach().numpy(), "dinitial": initial_state.grad.numpy()}
    result.update({f"d{name}": leaf.grad.numpy() for name, leaf in zip(NAMES, leaves)})
    return result


def run_cases(rank, world, cases, summary_exchange="all_gather"):
    return [run_rank_case(rank, world, case, summary_exchange) for case in cases]


def expected_for(case, world):
    """float64 oracle and the one-device op on the whole sequence, with the same states and cotangents."""
    arrays, initial, output_grad, final_grad = case_data(case, world)
    n = case["num_householder"]
    cu = None if case["lengths"] is None else cu_from_lengths(case["lengths"])
    float64 = oracle(arrays, num_householder=n, cu_seqlens=cu, l2norm=case["l2norm"], initial_state=initial,
                     output_grad=output_grad, final_state_grad=final_grad)
    leaves = [x.requires_grad_() for x in to_torch(arrays)]
    initial_state = torch.tensor(initial, dtype=torch.float32, requires_grad=True)
    o, final = gated_delta_product(*leaves, num_householder=n, cu_seqlens=None if cu is None else torch.tensor(cu),
                                   initial_state=initial_state, use_qk_l2norm_in_kernel=case["l2norm"])
    loss = (o * torch.tensor(output_grad, dtype=torch.float32)).sum()
    (loss + (final * torch.tensor(final_grad, dtype=torch.float32)).sum()).backward()
    one_device = {"o": o.detach().numpy(), "final": final.detach().numpy(), "dinitial": initial_state.grad.numpy()}
    one_device.update({f"d{name}": leaf.grad.numpy() for name, leaf in zip(NAMES, leaves)})
    return float64, one_device


def owner_ranks(case, world):
    """(rank holding each sequence's first token, rank holding its last), from the lengths (not the code)."""
    if case["lengths"] is None:
        return [0] * case["batch"], [world - 1] * case["batch"]
    stops = np.cumsum(case["lengths"])
    starts = stops - np.asarray(case["lengths"])
    return list(starts // LOCAL_LEN), list((stops - 1) // LOCAL_LEN)


def check_case(results, case, world):
    float64, one_device = expected_for(case, world)
    n = case["num_householder"]
    length = gdp_length(world * LOCAL_LEN, n, KEY_DIM)
    start_rank, end_rank = owner_ranks(case, world)
    for rank, got in enumerate(results):
        for row in range(len(start_rank)):  # rows owned elsewhere are exact zeros
            if end_rank[row] != rank:
                assert not np.any(got["final"][row]), f"{case['name']} rank {rank}: final row {row} is not zero"
            if start_rank[row] != rank:
                assert not np.any(got["dinitial"][row]), f"{case['name']} rank {rank}: dinitial row {row} not zero"
    summed = {key: sum(got[key] for got in results) for key in ("final", "dinitial")}
    for reference_name, expected, tol in (("float64", float64, tolerance(length)),
                                          ("one-device", one_device, tolerance(length, compared_with="rounded"))):
        label = f"{case['name']} (world {world}) vs {reference_name}"
        check_close(f"{label} final", summed["final"], expected["final"], tol)
        check_close(f"{label} dinitial", summed["dinitial"], expected["dinitial"], tol)
        for rank, got in enumerate(results):
            tok, step = local_slices(rank, n)
            check_close(f"{label} rank {rank} o", got["o"], expected["o"][:, tok], tol)
            for name in NAMES:
                sl = tok if name in ("q", "g") else step
                check_close(f"{label} rank {rank} d{name}", got[f"d{name}"], expected[f"d{name}"][:, sl], tol)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_states_and_all_gradients_match_float64_and_one_device(gloo_pools, world):
    cases = cases_for(world)
    per_rank = gloo_pools(world).run(run_cases, cases)
    for index, case in enumerate(cases):
        check_case([per_rank[rank][index] for rank in range(world)], case, world)


def test_states_through_the_summary_scan_match_one_device(gloo_pools):
    cases = cases_for(3)
    per_rank = gloo_pools(3).run(run_cases, cases, "scan")
    for index, case in enumerate(cases):
        check_case([per_rank[rank][index] for rank in range(3)], case, 3)


def run_final_state_only(rank, world, lengths):
    """A loss on the final state alone: the gradients reach every input through the backward summaries."""
    case = dict(name="final-only", lengths=lengths, batch=1, seed=5, num_householder=2, l2norm=False, chunk_size=8)
    arrays, initial, _, final_grad = case_data(case, world)
    tok, step = local_slices(rank, 2)
    leaves = [x[:, tok if name in ("q", "g") else step].contiguous().requires_grad_()
              for name, x in zip(NAMES, to_torch(arrays))]
    initial_state = torch.tensor(initial, dtype=torch.float32, requires_grad=True)
    _, final = gdp_chunkwise_context_parallel(*leaves, cp_group=dist.group.WORLD,
                                              global_seq_idx=seq_idx_from_lengths(lengths), num_householder=2,
                                              backend=TorchGDPBackend(8), initial_state=initial_state,
                                              output_final_state=True)
    (final * torch.tensor(final_grad, dtype=torch.float32)).sum().backward()
    return {"final": final.detach().numpy(), "dinitial": initial_state.grad.numpy(),
            **{f"d{name}": leaf.grad.numpy() for name, leaf in zip(NAMES, leaves)}}


def test_a_loss_on_the_final_state_alone_gives_every_gradient(gloo_pools):
    world, lengths = 3, [4, 22, 4]
    results = gloo_pools(world).run(run_final_state_only, lengths)
    case = dict(seed=5, batch=1, lengths=lengths, num_householder=2, l2norm=False)
    arrays, initial, _, final_grad = case_data(case, world)
    expected = oracle(arrays, num_householder=2, cu_seqlens=cu_from_lengths(lengths), initial_state=initial,
                      final_state_grad=final_grad)
    tol = tolerance(gdp_length(world * LOCAL_LEN, 2, KEY_DIM))
    check_close("final", sum(r["final"] for r in results), expected["final"], tol)
    check_close("dinitial", sum(r["dinitial"] for r in results), expected["dinitial"], tol)
    for rank, got in enumerate(results):
        tok, step = local_slices(rank, 2)
        for name in NAMES:
            check_close(f"rank {rank} d{name}", got[f"d{name}"],
                        expected[f"d{name}"][:, tok if name in ("q", "g") else step], tol)


def run_bad_initial_state(rank, world, bad_rank, kind):
    """Every rank calls with a valid initial state except ``bad_rank``; returns the error text."""
    q, k, v, g, beta = (torch.tensor(x[:, rank * LOCAL_LEN:(rank + 1) * LOCAL_LEN], dtype=torch.float32)
                        for x in gdp_arrays(3, tokens=world * LOCAL_LEN, heads=HEADS, key_dim=KEY_DIM,
                                            value_dim=VALUE_DIM))
    ids = seq_idx_from_lengths([5, world * LOCAL_LEN - 5])
    initial = torch.zeros(2, HEADS, KEY_DIM, VALUE_DIM)
    if rank == bad_rank:
        initial = {"rows": torch.zeros(3, HEADS, KEY_DIM, VALUE_DIM),
                   "transposed": torch.zeros(2, HEADS, VALUE_DIM, KEY_DIM),
                   "integer": torch.zeros(2, HEADS, KEY_DIM, VALUE_DIM, dtype=torch.int64),
                   "nan": torch.full((2, HEADS, KEY_DIM, VALUE_DIM), float("nan"))}[kind]
    try:
        gdp_chunkwise_context_parallel(q, k, v, g, beta, cp_group=dist.group.WORLD, global_seq_idx=ids,
                                       initial_state=initial, output_final_state=True)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("kind, match", [
    ("rows", r"initial_state must be a tensor \[N, H, K, V\] = \(2, 2, 8, 6\)"),
    ("transposed", r"initial_state must be a tensor \[N, H, K, V\] = \(2, 2, 8, 6\)"),
    ("integer", r"initial_state must be floating point"),
    ("nan", r"initial_state"),
])
def test_bad_initial_state_raises_the_same_error_on_every_rank(gloo_pools, kind, match):
    import re

    messages = gloo_pools(2).run(run_bad_initial_state, 1, kind)
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert re.search(match, messages[0]), messages[0]
    assert "rank 1" in messages[0]
