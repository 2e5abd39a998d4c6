"""``cp_linear::blockdiag_attention``: block-diagonal attention of one CP rank as a ``torch.library``
custom op (fake kernel, registered autograd), so that ``torch.compile(fullgraph=True)`` traces a
model through it without graph breaks.

The op takes q [B, L, Hq, D], k / v [B, L, Hkv, D] and the *name* of a ``BlockDiagRouting``
(``routing_name``; the routing holds the host plan and the exchange's index tensors) and returns
[B, L, Hq, D]. It runs the routing's exchange (collectives inside; the fake kernel needs none) and
the local doc-causal kernel. The backward op recomputes the exchange and the local attention with
autograd and differentiates them (the reverse exchange runs inside): the forward saves nothing but
its inputs, at the price of one more forward exchange in the backward. The cross-rank agreement
runs before the op (``blockdiag_attention``, ``ShardLayout.agree``), never inside it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from torch_api.gdp.library import _autograd_inside

_ROUTINGS: OrderedDict = OrderedDict()
_KEEP = 64  # routings kept by name: a step's layers share one; older steps' graphs have finished


def routing_name(routing) -> str:
    """A string naming ``routing`` for the op (the most recent ``_KEEP`` routings stay registered)."""
    name = f"routing@{id(routing):x}"
    _ROUTINGS[name] = routing
    _ROUTINGS.move_to_end(name)
    while len(_ROUTINGS) > _KEEP:
        _ROUTINGS.popitem(last=False)
    return name


def _attend(q, k, v, routing, scale, kernel, contain):
    from torch_api.attention.blockdiag import exchange_window
    from torch_api.attention.exchange import stack_kv, unstack_kv
    from torch_api.attention.kernel import doc_causal_attention

    window = exchange_window(routing, stack_kv(k, v))
    start = routing.exchange.window_start
    outputs = []
    for piece in routing.pieces:  # the shard, or each zig-zag chunk with its own key range
        k_window, v_window = unstack_kv(window[piece.key_start - start:piece.key_stop - start])
        outputs.append(doc_causal_attention(q[:, piece.query_lo:piece.query_hi], k_window, v_window, piece.layout,
                                            scale=scale, kernel=kernel, contain=contain))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def _scale(scale: float, q: torch.Tensor) -> float:
    return q.shape[-1] ** -0.5 if scale <= 0 else scale


@torch.library.custom_op("cp_linear::blockdiag_attention", mutates_args=())
def blockdiag_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, routing: str, scale: float,
                           kernel: str, contain: bool) -> torch.Tensor:
    """scale <= 0 means D**-0.5; contain: non-finite inputs contained (outputs reading them NaN)."""
    with torch.no_grad():
        out = _attend(q, k, v, _ROUTINGS[routing], _scale(scale, q), kernel, contain)
    return out.contiguous() if out.storage_offset() == 0 else out.clone(memory_format=torch.contiguous_format)


@blockdiag_attention_op.register_fake
def _(q, k, v, routing, scale, kernel, contain):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("cp_linear::blockdiag_attention_backward", mutates_args=())
def blockdiag_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, routing: str,
                                 scale: float, kernel: str, contain: bool
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with _autograd_inside():
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        out = _attend(*leaves, _ROUTINGS[routing], _scale(scale, q), kernel, contain)
        grads = torch.autograd.grad(out, leaves, do, allow_unused=True)
    return tuple(torch.zeros_like(x, memory_format=torch.contiguous_format) if grad is None
                 else grad.clone(memory_format=torch.contiguous_format) for grad, x in zip(grads, (q, k, v)))


@blockdiag_attention_backward.register_fake
def _(do, q, k, v, routing, scale, kernel, contain):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup(ctx, inputs, output):
    q, k, v, routing, scale, kernel, contain = inputs
    ctx.save_for_backward(q, k, v)
    ctx.options = (routing, scale, kernel, contain)


def _backward(ctx, do):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = blockdiag_attention_backward(do.contiguous(), q, k, v, *ctx.options)
    return dq, dk, dv, None, None, None, None


blockdiag_attention_op.register_autograd(_backward, setup_context=_setup)

# --------------------------------------------------------------------------- the conv's left halo


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@torch.library.custom_op("cp_linear::left_halo", mutates_args=())
def left_halo_op(x: torch.Tensor, halo_len: int, group_name: str) -> torch.Tensor:
    """x [L, *rest] (token-major) -> [halo_len + L, *rest]: the left neighbour's last ``halo_len``
    tokens (zeros on rank 0), then x (``torch_api.attention.exchange.left_halo_forward``)."""
    from torch_api.attention.exchange import left_halo_forward

    return left_halo_forward(x.contiguous(), halo_len, _group(group_name))


@left_halo_op.register_fake
def _(x, halo_len, group_name):
    return x.new_empty((halo_len + x.shape[0], *x.shape[1:]))


@torch.library.custom_op("cp_linear::left_halo_backward", mutates_args=())
def left_halo_backward_op(grad_window: torch.Tensor, halo_len: int, group_name: str) -> torch.Tensor:
    from torch_api.attention.exchange import left_halo_backward

    return left_halo_backward(grad_window.contiguous(), halo_len, _group(group_name))


@left_halo_backward_op.register_fake
def _(grad_window, halo_len, group_name):
    return grad_window.new_empty((grad_window.shape[0] - halo_len, *grad_window.shape[1:]))


def _halo_setup(ctx, inputs, output):
    ctx.options = inputs[1:]


def _halo_backward(ctx, grad_window):
    return left_halo_backward_op(grad_window, *ctx.options), None, None


left_halo_op.register_autograd(_halo_backward, setup_context=_halo_setup)


@torch.library.custom_op("cp_linear::left_halo_gathered", mutates_args=())
def left_halo_gathered_op(x: torch.Tensor, halo_len: int, group_name: str) -> torch.Tensor:
    """``left_halo_op`` through an all-gather (fixed shapes, collectives only: graph-ready layouts;
    ``torch_api.attention.exchange.left_halo_gathered_forward``)."""
    from torch_api.attention.exchange import left_halo_gathered_forward

    return left_halo_gathered_forward(x.contiguous(), halo_len, _group(group_name))


@left_halo_gathered_op.register_fake
def _(x, halo_len, group_name):
    return x.new_empty((halo_len + x.shape[0], *x.shape[1:]))


@torch.library.custom_op("cp_linear::left_halo_gathered_backward", mutates_args=())
def left_halo_gathered_backward_op(grad_window: torch.Tensor, halo_len: int, group_name: str) -> torch.Tensor:
    from torch_api.attention.exchange import left_halo_gathered_backward

    return left_halo_gathered_backward(grad_window.contiguous(), halo_len, _group(group_name))


@left_halo_gathered_backward_op.register_fake
def _(grad_window, halo_len, group_name):
    return grad_window.new_empty((grad_window.shape[0] - halo_len, *grad_window.shape[1:]))


def _gathered_halo_backward(ctx, grad_window):
    return left_halo_gathered_backward_op(grad_window, *ctx.options), None, None


left_halo_gathered_op.register_autograd(_gathered_halo_backward, setup_context=_halo_setup)

__all__ = ["blockdiag_attention_op", "left_halo_gathered_op", "left_halo_op", "routing_name"]
