"""Differentiable K/V exchanges for block-diagonal attention under CP (torch.distributed).

Every exchange moves a *token-major* buffer ``kv`` [L, B, 2, Hkv, D] (K and V stacked, so both travel
in one collective) and returns a contiguous window of global tokens, also token-major:

  all_gather_kv          window [0, T)                      backward: reduce-scatter (sum)
  left_halo_kv           window [r*L - halo_len, (r+1)*L)   backward: the reverse neighbour exchange,
                         (rank 0's halo rows are zeros)      gradients added onto the sender's tail
  needed_kv_all_to_all   window [s_first[r], real_end[r])   backward: reverse all-to-all-v + index_add_

Worked example: T = 12, cp_size = 3, L = 4, document 2 spans tokens 3..9::

    global  0 1 2 3 | 4 5 6 7 | 8 9 10 11
    doc     1 1 1 2 | 2 2 2 2 | 2 2  .  .
    rank 2 needs [3, 10): 3 from rank 0, 4..7 from rank 1, 8..9 from itself (back = 5 > L, so no halo)
    all-to-all-v on rank 0: in_splits = [4, 1, 1] (tokens 0..3 to itself, token 3 to ranks 1 and 2)

Gloo on this torch build supports all three collectives with uneven splits and empty pieces
(checked by tests/torch_api/test_blockdiag_exchange.py), so nothing is emulated with point-to-point ops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def stack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k/v [B, L, Hkv, D] -> token-major kv [L, B, 2, Hkv, D] (one copy)."""
    return torch.stack((k.transpose(0, 1), v.transpose(0, 1)), dim=2)


def unstack_kv(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major kv [N, B, 2, Hkv, D] -> views k, v [B, N, Hkv, D]."""
    return kv[:, :, 0].transpose(0, 1), kv[:, :, 1].transpose(0, 1)


def _all_gather(out: torch.Tensor, local: torch.Tensor, group) -> None:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; older builds have only the former
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local, group=group)


def _reduce_scatter_sum(out: torch.Tensor, full: torch.Tensor, group) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, full, op=dist.ReduceOp.SUM, group=group)


def _exchange_with_neighbours(group, send: torch.Tensor | None, send_to: int | None,
                              recv: torch.Tensor | None, recv_from: int | None) -> None:
    """One batch_isend_irecv; peers are group ranks. Both ops are posted before any wait: no deadlock."""
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, dist.get_global_rank(group, send_to), group))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, recv_from), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _AllGatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, group):
        ctx.group = group
        world = dist.get_world_size(group)
        kv = kv.contiguous()
        window = kv.new_empty((world * kv.shape[0], *kv.shape[1:]))
        _all_gather(window, kv, group)
        return window

    @staticmethod
    def backward(ctx, grad_window):
        world = dist.get_world_size(ctx.group)
        grad_window = grad_window.contiguous()
        grad_kv = grad_window.new_empty((grad_window.shape[0] // world, *grad_window.shape[1:]))
        _reduce_scatter_sum(grad_kv, grad_window, ctx.group)
        return grad_kv, None


def left_halo_forward(kv: torch.Tensor, halo_len: int, group) -> torch.Tensor:
    """The left-halo exchange without autograd: kv [L, *rest] -> [halo_len + L, *rest]."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    local_len = kv.shape[0]
    window = kv.new_empty((halo_len + local_len, *kv.shape[1:]))
    window[halo_len:].copy_(kv)
    if halo_len:
        if rank == 0:
            window[:halo_len].zero_()
        has_right, has_left = rank + 1 < world, rank > 0
        # window[local_len:] is the last halo_len local tokens (the copy above)
        _exchange_with_neighbours(group, window[local_len:] if has_right else None, rank + 1,
                                  window[:halo_len] if has_left else None, rank - 1)
    return window


def left_halo_backward(grad_window: torch.Tensor, halo_len: int, group) -> torch.Tensor:
    """The reverse exchange: grad_window [halo_len + L, *rest] -> grad kv [L, *rest]."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    grad_kv = grad_window[halo_len:].clone(memory_format=torch.contiguous_format)
    if halo_len:
        local_len = grad_kv.shape[0]
        has_right, has_left = rank + 1 < world, rank > 0
        from_right = grad_kv.new_empty((halo_len, *grad_kv.shape[1:])) if has_right else None
        to_left = grad_window[:halo_len].contiguous() if has_left else None
        _exchange_with_neighbours(group, to_left, rank - 1, from_right, rank + 1)
        if from_right is not None:
            grad_kv[local_len - halo_len:] += from_right
    return grad_kv


def left_halo_gathered_forward(kv: torch.Tensor, halo_len: int, group) -> torch.Tensor:
    """``left_halo_forward`` through one all-gather of every rank's last ``halo_len`` tokens instead
    of a neighbour exchange: collectives only, with shapes fixed by (L, halo_len, cp_size), which a CUDA
    graph captures like the other collectives of a step (graph-ready layouts, torch_api.layers.layout).
    Moves (cp_size - 1) * halo_len tokens per rank where the exchange moves halo_len: the conv's halo is
    a few tokens. kv [L, *rest] -> [halo_len + L, *rest]; the same values as ``left_halo_forward``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    local_len = kv.shape[0]
    if not halo_len:
        return kv.clone(memory_format=torch.contiguous_format)
    tails = kv.new_empty((world * halo_len, *kv.shape[1:]))
    _all_gather(tails, kv[local_len - halo_len:].contiguous(), group)
    halo = tails[(rank - 1) * halo_len:rank * halo_len] if rank > 0 else torch.zeros_like(tails[:halo_len])
    return torch.cat((halo, kv), dim=0)


def left_halo_gathered_backward(grad_window: torch.Tensor, halo_len: int, group) -> torch.Tensor:
    """The adjoint of ``left_halo_gathered_forward``: each rank puts its halo's gradient in the slot of
    the rank it came from and one reduce-scatter (sum) hands every rank the gradient of its own tail
    (zeros added elsewhere, so the values equal ``left_halo_backward``'s)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    grad_kv = grad_window[halo_len:].clone(memory_format=torch.contiguous_format)
    if not halo_len:
        return grad_kv
    local_len = grad_kv.shape[0]
    slots = grad_window.new_zeros((world * halo_len, *grad_window.shape[1:]))
    if rank > 0:
        slots[(rank - 1) * halo_len:rank * halo_len] = grad_window[:halo_len]
    from_right = grad_window.new_empty((halo_len, *grad_window.shape[1:]))
    _reduce_scatter_sum(from_right, slots, group)
    grad_kv[local_len - halo_len:] += from_right
    return grad_kv


class _LeftHaloKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, halo_len, group):
        ctx.group, ctx.halo_len = group, halo_len
        return left_halo_forward(kv, halo_len, group)

    @staticmethod
    def backward(ctx, grad_window):
        return left_halo_backward(grad_window, ctx.halo_len, ctx.group), None, None


class _NeededKVAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, send_index, in_splits, out_splits, group):
        ctx.group, ctx.in_splits, ctx.out_splits, ctx.local_len = group, in_splits, out_splits, kv.shape[0]
        ctx.save_for_backward(send_index)
        send = kv.index_select(0, send_index)
        window = kv.new_empty((sum(out_splits), *kv.shape[1:]))
        dist.all_to_all_single(window, send, out_splits, in_splits, group=group)
        return window

    @staticmethod
    def backward(ctx, grad_window):
        (send_index,) = ctx.saved_tensors
        grad_window = grad_window.contiguous()
        grad_sent = grad_window.new_empty((sum(ctx.in_splits), *grad_window.shape[1:]))
        dist.all_to_all_single(grad_sent, grad_window, ctx.in_splits, ctx.out_splits, group=ctx.group)
        # a token sent to several ranks comes back once per destination: index_add_ sums them
        grad_kv = grad_window.new_zeros((ctx.local_len, *grad_window.shape[1:]))
        grad_kv.index_add_(0, send_index, grad_sent)
        return grad_kv, None, None, None, None


def all_gather_kv(kv: torch.Tensor, group) -> torch.Tensor:
    """kv [L, *rest] -> every rank's shard in rank order, [cp_size * L, *rest] (global [0, T))."""
    return _AllGatherKV.apply(kv, group)


def left_halo_kv(kv: torch.Tensor, halo_len: int, group) -> torch.Tensor:
    """kv [L, *rest] -> [halo_len + L, *rest]: the left neighbour's last ``halo_len`` tokens, then kv.

    ``halo_len`` (≤ L) must be equal on every rank; rank 0's halo rows are zeros.
    """
    if not 0 <= halo_len <= kv.shape[0]:
        raise ValueError(f"halo_len must be in [0, L = {kv.shape[0]}]; received {halo_len}")
    return _LeftHaloKV.apply(kv, int(halo_len), group)


def needed_kv_all_to_all(kv: torch.Tensor, send_index: torch.Tensor, in_splits: list[int],
                         out_splits: list[int], group) -> torch.Tensor:
    """kv [L, *rest] -> [sum(out_splits), *rest]: the pieces from each source, in source order.

    ``in_splits[dst]`` tokens go to ``dst``, taken from ``kv[send_index]`` in destination order;
    ``out_splits[src]`` tokens arrive from ``src`` (``cp_linear.needed_kv_a2a_splits``).
    """
    return _NeededKVAllToAll.apply(kv, send_index, list(in_splits), list(out_splits), group)


__all__ = ["all_gather_kv", "left_halo_gathered_backward", "left_halo_gathered_forward", "left_halo_kv", "needed_kv_all_to_all", "stack_kv", "unstack_kv"]
