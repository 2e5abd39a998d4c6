"""``summary_exchange="scan"`` (log-depth point-to-point prefix fold) against the all-gather path.

Host: the scan schedule, simulated with numpy summaries, folds exactly the ranks the all-gather slice
[preceding_rank_start, rank) / [rank + 1, following_rank_stop) names, in at most ceil(log2 cp)
rounds. Gloo, world 2-4: the op's outputs and all five gradients through the scan equal the
all-gather path's (float32, 1e-6 relative), for packed layouts, batch rows and unpacked summaries.
"""

import math
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cp_linear import build_packed_sequence_cp_metadata, sequence_state_routing
from cp_linear.summary import combine, compose_backward, compose_forward
from tests.cp_linear.gdp_cases import rel_err, seq_idx_from_lengths
from tests.torch_api.test_gdp_chunk import NAMES, gdp_arrays, to_torch
from torch_api.gdp.chunk import TorchGDPBackend
from torch_api.gdp.cp import gdp_chunkwise_context_parallel
from cp_linear.summary_exchange import SCAN_MIN_WORLD, resolve_summary_exchange, scan_schedule

LOCAL_LEN = 8
HEADS, KEY_DIM, VALUE_DIM = 2, 4, 3


def layouts(world):
    total, L = world * LOCAL_LEN, LOCAL_LEN
    return {
        "one-sequence": [total],
        "boundaries": [L] * world,
        "spans-and-short": [3, total - 6, 1, 2],
        "starts-at-a-boundary-then-spans": [L, total - L - 1, 1] if world > 2 else [L, L - 1, 1],
        "many-per-rank": [1] * (L + 1) + [total - L - 1],
        "rows": None,
    }


# --------------------------------------------------------------------------- host: the schedule


def simulate(schedule, summaries):
    """Run the schedule's messages with numpy summaries [w, H, K, V + K] (in scan order); -> per rank the
    folded stack [n, ...] the exchange hands the backend."""
    world = schedule.world
    inclusive = [summaries[schedule.rank_at(p)] for p in range(world)]
    exclusive = [None] * world
    for messages in schedule.rounds:
        sent = {receiver: inclusive[sender] for sender, receiver in messages}
        for receiver, value in sent.items():
            exclusive[receiver] = value if exclusive[receiver] is None else combine(value, exclusive[receiver])
            if not schedule.stops[receiver]:
                inclusive[receiver] = combine(value, inclusive[receiver])
    return [exclusive[schedule.position_of(r)][None] if not schedule.empty[schedule.position_of(r)]
            else np.zeros((0, *summaries.shape[1:])) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("name", ["one-sequence", "boundaries", "spans-and-short", "starts-at-a-boundary-then-spans",
                                  "many-per-rank", "rows"])
def test_scan_schedule_folds_exactly_the_all_gather_slice(world, name):
    lengths = layouts(world)[name]
    rng = np.random.default_rng(world)
    forward = rng.normal(size=(world, HEADS, KEY_DIM, VALUE_DIM + KEY_DIM))
    backward = rng.normal(size=(world, HEADS, KEY_DIM, VALUE_DIM + KEY_DIM))
    if lengths is None:
        routing = sequence_state_routing(None, world, rows=1)
        ranges = [(0, world)] * world
    else:
        ids = seq_idx_from_lengths(lengths)
        routing = sequence_state_routing(ids, world)
        ranges = [(m.preceding_rank_start, m.following_rank_stop)
                  for m in (build_packed_sequence_cp_metadata(ids, r, world) for r in range(world))]
    forward_schedule = scan_schedule(routing, descending=False)
    backward_schedule = scan_schedule(routing, descending=True)
    got_forward = simulate(forward_schedule, forward)
    got_backward = simulate(backward_schedule, backward)
    state = rng.normal(size=(HEADS, KEY_DIM, VALUE_DIM))
    for r, (start, stop) in enumerate(ranges):
        assert got_forward[r].shape[0] == (1 if start < r else 0), (r, start)
        assert got_backward[r].shape[0] == (1 if r + 1 < stop else 0), (r, stop)
        if start < r:  # the folded summary acts on any state like the slice, not only on zero
            np.testing.assert_allclose(compose_forward(got_forward[r], state),
                                       compose_forward(forward[start:r], state), rtol=1e-12, atol=1e-12)
        if r + 1 < stop:
            np.testing.assert_allclose(compose_backward(got_backward[r]), compose_backward(backward[r + 1:stop]),
                                       rtol=1e-12, atol=1e-12)
    bound = math.ceil(math.log2(world))
    for schedule in (forward_schedule, backward_schedule):
        assert len(schedule.rounds) <= bound
        assert max(schedule.received_per_rank()) <= bound


def test_auto_scans_from_the_measured_threshold():
    assert resolve_summary_exchange("auto", SCAN_MIN_WORLD - 1) == "all_gather"
    assert resolve_summary_exchange("auto", SCAN_MIN_WORLD) == "scan"
    assert resolve_summary_exchange("scan", 2) == "scan"
    assert resolve_summary_exchange("ring", 2) is None


# --------------------------------------------------------------------------- gloo: scan == all_gather


def run_both(rank, world, backend_kind="torch"):
    from tests.torch_api.test_gdp_cp import UnpackedSummaryBackend

    results = []
    for index, (name, lengths) in enumerate(layouts(world).items()):
        batch = 2 if lengths is None else 1
        n_h = 1 + index % 3
        arrays = to_torch(gdp_arrays(10 * world + index, batch=batch, tokens=world * LOCAL_LEN, heads=HEADS,
                                     key_dim=KEY_DIM, value_dim=VALUE_DIM, num_householder=n_h))
        tok = slice(rank * LOCAL_LEN, (rank + 1) * LOCAL_LEN)
        step = slice(tok.start * n_h, tok.stop * n_h)
        do = torch.randn(batch, LOCAL_LEN, HEADS, VALUE_DIM, generator=torch.Generator().manual_seed(rank))
        per_exchange = {}
        for exchange in ("all_gather", "scan"):
            leaves = [x[:, tok if n in ("q", "g") else step].contiguous().requires_grad_()
                      for n, x in zip(NAMES, arrays)]
            backend = UnpackedSummaryBackend(8) if backend_kind == "unpacked" else TorchGDPBackend(8)
            output = gdp_chunkwise_context_parallel(
                *leaves, cp_group=dist.group.WORLD, num_householder=n_h, backend=backend,
                global_seq_idx=None if lengths is None else seq_idx_from_lengths(lengths), summary_exchange=exchange)
            (output * do).sum().backward()
            per_exchange[exchange] = {"o": output.detach().numpy(),
                                      **{f"d{n}": leaf.grad.numpy() for n, leaf in zip(NAMES, leaves)}}
        results.append((name, per_exchange))
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3, 4])
def test_scan_matches_all_gather_forward_and_backward(gloo_pools, world):
    for rank, cases in enumerate(gloo_pools(world).run(run_both)):
        for name, got in cases:
            for key, expected in got["all_gather"].items():
                assert np.any(expected), f"{name} rank {rank} {key}: all zeros, the comparison would be empty"
                err = rel_err(got["scan"][key], expected)
                assert err <= 1e-6, f"{name} rank {rank} {key}: scan vs all_gather rel err {err:.2e}"


@pytest.mark.multirank
def test_scan_returns_summaries_in_the_backends_unpacked_form(gloo_pools):
    for rank, cases in enumerate(gloo_pools(3).run(run_both, "unpacked")):
        for name, got in cases:
            for key, expected in got["all_gather"].items():
                assert rel_err(got["scan"][key], expected) <= 1e-6, (name, rank, key)


def run_bad_exchange(rank, world):
    q, k, v, g, beta = (x[:, rank * LOCAL_LEN:(rank + 1) * LOCAL_LEN].contiguous() for x in
                        to_torch(gdp_arrays(1, tokens=world * LOCAL_LEN, heads=HEADS, key_dim=KEY_DIM,
                                            value_dim=VALUE_DIM)))
    try:
        gdp_chunkwise_context_parallel(q, k, v, g, beta, cp_group=dist.group.WORLD,
                                       summary_exchange="ring" if rank == 1 else "scan")
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.multirank
def test_unknown_summary_exchange_raises_the_same_error_on_every_rank(gloo_pools):
    messages = gloo_pools(2).run(run_bad_exchange)
    assert messages[0] is not None and messages[0] == messages[1]
    assert re.search(r"summary_exchange must be one of .* received 'ring'", messages[0])
