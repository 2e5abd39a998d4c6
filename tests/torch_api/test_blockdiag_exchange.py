"""The three K/V exchanges on real gloo groups: forward windows and backward sums (float64)."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cp_linear import build_blockdiag_plan, needed_kv_a2a_splits
from tests.tolerance import assert_within, rel_err, tolerance

pytestmark = pytest.mark.multirank

LOCAL_LEN, REST = 4, (2, 3)
# cp 3, L = 4: doc 2 spans tokens 3..9, so a2a sends rank 0's token 3 to ranks 0, 1 and 2
DOC_IDS = [1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 0, 0]


def global_kv(tokens):
    """Token g holds g + 0.01 * (0..5): every row is distinguishable."""
    return torch.arange(tokens, dtype=torch.float64)[:, None, None] + 0.01 * torch.arange(6.0).view(1, *REST)


def cotangent(rank, rows):
    """The upstream gradient rank ``rank`` feeds into its window (known to every rank)."""
    return torch.randn((rows, *REST), generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def check_exchanges(rank, world_size):
    from torch_api.attention.exchange import all_gather_kv, left_halo_kv, needed_kv_all_to_all

    group = dist.group.WORLD
    tokens = world_size * LOCAL_LEN
    full = global_kv(tokens)
    shard = slice(rank * LOCAL_LEN, (rank + 1) * LOCAL_LEN)
    errors = {}

    def grad_of(window_fn):
        kv = full[shard].clone().requires_grad_()
        window = window_fn(kv)
        window.backward(cotangent(rank, window.shape[0]))
        return window.detach(), kv.grad

    # all-gather: window = everything; gradient = sum over ranks of their cotangent rows for my shard
    window, grad = grad_of(lambda kv: all_gather_kv(kv, group))
    expected = sum(cotangent(r, tokens)[shard] for r in range(world_size))
    errors["allgather_forward"] = rel_err(window, full)
    errors["allgather_backward"] = rel_err(grad, expected)

    # left halo of 3: window = left neighbour's last 3 tokens (zeros on rank 0), then mine
    halo = 3
    window, grad = grad_of(lambda kv: left_halo_kv(kv, halo, group))
    head = full[shard.start - halo:shard.start] if rank else torch.zeros((halo, *REST), dtype=torch.float64)
    errors["halo_forward"] = rel_err(window, torch.cat([head, full[shard]]))
    expected = cotangent(rank, halo + LOCAL_LEN)[halo:].clone()
    if rank + 1 < world_size:
        expected[LOCAL_LEN - halo:] += cotangent(rank + 1, halo + LOCAL_LEN)[:halo]
    errors["halo_backward"] = rel_err(grad, expected)

    # halo of 0 moves nothing
    window, grad = grad_of(lambda kv: left_halo_kv(kv, 0, group))
    errors["halo0"] = rel_err(window, full[shard]) + rel_err(grad, cotangent(rank, LOCAL_LEN))

    # needed-only a2a: window = [s_first, real_end); gradient = every destination's rows for my tokens, summed
    plan = build_blockdiag_plan(np.array(DOC_IDS), world_size)  # world_size = 3
    in_splits, out_splits, send_index = needed_kv_a2a_splits(plan, rank)
    window, grad = grad_of(lambda kv: needed_kv_all_to_all(kv, torch.from_numpy(send_index), in_splits,
                                                           out_splits, group))
    errors["a2a_forward"] = rel_err(window, full[plan.s_first[rank]:plan.real_end[rank]])
    expected = torch.zeros_like(full)
    for dst in range(world_size):
        start, stop = plan.s_first[dst], plan.real_end[dst]
        expected[start:stop] += cotangent(dst, stop - start)
    errors["a2a_backward"] = rel_err(grad, expected[shard])
    errors["a2a_most_copies_of_a_token"] = float(np.bincount(send_index, minlength=LOCAL_LEN).max())
    return errors


def test_exchanges_deliver_their_windows_and_sum_gradients_back(gloo_pools):
    per_rank = gloo_pools(3).run(check_exchanges)
    for rank, errors in enumerate(per_rank):
        copies = errors.pop("a2a_most_copies_of_a_token")
        # moved rows are bit-exact; a sum of up to three float64 cotangents may differ by the reduction order
        for name, error in errors.items():
            assert_within(f"rank {rank} {name}", error, tolerance(3, dtype="float64", compared_with="rounded"))
        # token 3 goes to ranks 0, 1, 2; rank 1's tokens to ranks 1, 2; rank 2 keeps its own
        assert copies == [3.0, 2.0, 1.0][rank]


def bf16_attention(rank, world_size):
    """bf16 in, bf16 out, through a halo exchange (doc ids as numpy); vs the float64 reference."""
    from cp_linear.reference import blockdiag_attention as reference
    from torch_api import blockdiag_attention

    doc_ids = [1] * 5 + [2] * 9 + [0] * 2
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 16, 2, 16, generator=gen) for _ in range(3))
    local = slice(rank * 8, rank * 8 + 8)
    args = [t[:, local].bfloat16().requires_grad_() for t in (q, k, v)]
    out = blockdiag_attention(*args, np.array(doc_ids), cp_group=dist.group.WORLD)
    out.float().sum().backward()
    ref = reference(q.bfloat16().double().numpy(), k.bfloat16().double().numpy(), v.bfloat16().double().numpy(),
                    np.array(doc_ids))[:, local]
    return out.dtype, [t.grad.dtype for t in args], rel_err(out.detach().double().numpy(), ref)


def test_bf16_inputs_give_bf16_outputs_and_gradients(gloo_pools):
    for dtype, grad_dtypes, rel in gloo_pools(2).run(bf16_attention):
        assert dtype == torch.bfloat16 and grad_dtypes == [torch.bfloat16] * 3
        # bfloat16 roundings of the scores, the probabilities and the output (sums accumulate in float32)
        assert_within("bf16 output", rel, tolerance(3, dtype="bfloat16"))
