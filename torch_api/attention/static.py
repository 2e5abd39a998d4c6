"""Block-diagonal attention with shapes fixed by (T, cp_size): the graph-ready path.

``cp_linear::blockdiag_attention_static`` takes the *global* doc ids as a device tensor int32 [T]
(0 = padding), not a host plan, so a new packing changes tensor values only: ``torch.compile``
traces it once and a CUDA graph captured on one packing replays another (the ids live in a buffer
that ``ShardLayout.copy_packing_`` rewrites). What it gives up for that:

  exchange   an all-gather of K/V (backward: reduce-scatter), every rank receives (cp - 1) * L tokens;
             the halo / a2a exchanges of ``torch_api.attention.blockdiag`` move less but their sizes
             follow the packing (docs/design.md §3)
  mask       built on the device from the ids for the window [0, T): query p (global) reads key j
             iff doc(p) == doc(j) > 0 and j <= p. "sdpa" makes a dense bool mask per fixed block of
             ``QUERY_BLOCK`` queries over keys [0, block end) (exact, any device); "flex" builds the
             BlockMask on the device (``create_block_mask``) every call, from the same rule

Padding rows output exactly 0 and get zero gradient, as in ``doc_causal_attention``. ``contain``
(values unchecked): the kernel runs on sanitised q/k/v and a real query is NaN exactly when its own
q or a key/value it may read is non-finite (``cp_linear.validation``). One device: ``group_name``
"" (no exchange, ``query_start`` 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cp_linear.validation import any_in_ranges, nonfinite_rows, poison, sanitize
from torch_api.gdp.library import _autograd_inside

QUERY_BLOCK = 1024  # queries per SDPA call of the "sdpa" kernel: bounds the dense mask to QUERY_BLOCK x T


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _run_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """int64 [T]: global index where each token's run of equal ids begins (device, no host read)."""
    index = torch.arange(doc_ids.shape[0], device=doc_ids.device)
    new_run = torch.ones_like(doc_ids, dtype=torch.bool)
    new_run[1:] = doc_ids[1:] != doc_ids[:-1]
    return torch.cummax(torch.where(new_run, index, 0), dim=0).values


def _allowed(query_doc, query_pos, key_doc, key_pos) -> torch.Tensor:
    """bool [Lq, Nk]: the doc-causal rule; a padding row reads itself only (no fully masked row, whose
    SDPA output would be NaN; it is zeroed afterwards)."""
    same = (query_doc[:, None] == key_doc[None, :]) & (key_pos[None, :] <= query_pos[:, None])
    real = query_doc[:, None] > 0
    return torch.where(real, same, key_pos[None, :] == query_pos[:, None])


def _sdpa(q, k, v, doc_ids, query_start, scale):
    """q [B, Lq, Hq, D], k/v [B, T, Hkv, D] (the whole sequence) -> [B, Lq, Hq, D]."""
    batch, queries, q_heads, _ = q.shape
    group = q_heads // k.shape[2]
    q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if q.is_cuda and group > 1:  # the CUDA SDPA backends want equal head counts
        k_t, v_t = k_t.repeat_interleave(group, dim=1), v_t.repeat_interleave(group, dim=1)
    gqa = {} if q_t.shape[1] == k_t.shape[1] else {"enable_gqa": True}
    key_pos = torch.arange(k.shape[1], device=q.device)
    pieces = []
    for lo in range(0, queries, QUERY_BLOCK):  # fixed blocks: shapes depend on Lq and T only
        hi = min(lo + QUERY_BLOCK, queries)
        keys = query_start + hi  # causal: nothing past the block's last query
        query_pos = torch.arange(query_start + lo, query_start + hi, device=q.device)
        mask = _allowed(doc_ids[query_start + lo:query_start + hi], query_pos, doc_ids[:keys], key_pos[:keys])
        pieces.append(F.scaled_dot_product_attention(q_t[:, :, lo:hi], k_t[:, :, :keys], v_t[:, :, :keys],
                                                     attn_mask=mask, scale=scale, **gqa))
    return torch.cat(pieces, dim=2).transpose(1, 2)


def _flex(q, k, v, doc_ids, query_start, scale):
    from torch.nn.attention.flex_attention import create_block_mask

    from torch_api.attention.kernel import FLEX_BLOCK, _flex_fn

    def doc_causal(b, h, q_idx, kv_idx):
        query = q_idx + query_start
        return (doc_ids[query] == doc_ids[kv_idx]) & (kv_idx <= query) & (doc_ids[query] > 0)

    block_mask = create_block_mask(doc_causal, None, None, q.shape[1], k.shape[1], device=q.device,
                                   BLOCK_SIZE=FLEX_BLOCK)
    out = _flex_fn(q.device)(q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(),
                             block_mask=block_mask, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _attend(q, k, v, doc_ids, query_start: int, group_name: str, scale: float, kernel: str, contain: bool):
    from torch_api.attention.exchange import all_gather_kv, stack_kv, unstack_kv

    if group_name:
        k, v = unstack_kv(all_gather_kv(stack_kv(k, v), _group(group_name)))  # [B, T, Hkv, D] each
    doc_ids = doc_ids.to(torch.int64)
    queries = q.shape[1]
    query_doc = doc_ids[query_start:query_start + queries]
    real = (query_doc > 0).view(1, -1, 1, 1)
    scale = q.shape[-1] ** -0.5 if scale <= 0 else scale
    bad = None
    if contain:
        with torch.no_grad():
            start = _run_starts(doc_ids)[query_start:query_start + queries]
            stop = torch.arange(query_start + 1, query_start + queries + 1, device=q.device)
            stop = torch.where(query_doc > 0, stop, start)  # padding reads nothing
            reads_bad = any_in_ranges(nonfinite_rows(k, 1) | nonfinite_rows(v, 1), start, stop)  # [B, Lq, Hkv]
            group = q.shape[2] // k.shape[2]
            bad = nonfinite_rows(q, 1) | (reads_bad.repeat_interleave(group, dim=2) if group > 1 else reads_bad)
        q, k, v = sanitize(q), sanitize(k), sanitize(v)
    attend = _flex if kernel == "flex" else _sdpa
    out = torch.where(real, attend(q, k, v, doc_ids, query_start, scale), 0.0)
    if bad is not None:
        out = poison(out, (bad & real[..., 0])[..., None])
    return out


@torch.library.custom_op("cp_linear::blockdiag_attention_static", mutates_args=())
def static_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, query_start: int,
                        group_name: str, scale: float, kernel: str, contain: bool) -> torch.Tensor:
    """q [B, L, Hq, D], k/v [B, L, Hkv, D] (local shards), doc_ids int [T] global (device) -> [B, L, Hq, D].
    query_start: global index of the first local query (rank * L); group_name "" on one device;
    scale <= 0 means D**-0.5; kernel "sdpa" or "flex"."""
    with torch.no_grad():
        out = _attend(q, k, v, doc_ids, query_start, group_name, scale, kernel, contain)
    return out.contiguous()  # torch.where made it: never an alias of an input


@static_attention_op.register_fake
def _(q, k, v, doc_ids, query_start, group_name, scale, kernel, contain):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("cp_linear::blockdiag_attention_static_backward", mutates_args=())
def static_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              doc_ids: torch.Tensor, query_start: int, group_name: str, scale: float, kernel: str,
                              contain: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute (the all-gather included) with autograd and differentiate: the reduce-scatter of the
    K/V gradients runs inside, so the forward saves nothing but its inputs."""
    with _autograd_inside():
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        out = _attend(*leaves, doc_ids, query_start, group_name, scale, kernel, contain)
        grads = torch.autograd.grad(out, leaves, do, allow_unused=True)
    return tuple(torch.zeros_like(x, memory_format=torch.contiguous_format) if grad is None
                 else grad.clone(memory_format=torch.contiguous_format) for grad, x in zip(grads, (q, k, v)))


@static_attention_backward.register_fake
def _(do, q, k, v, doc_ids, query_start, group_name, scale, kernel, contain):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup(ctx, inputs, output):
    q, k, v, doc_ids, *options = inputs
    ctx.save_for_backward(q, k, v, doc_ids)
    ctx.options = tuple(options)


def _backward(ctx, do):
    q, k, v, doc_ids = ctx.saved_tensors
    dq, dk, dv = static_attention_backward(do.contiguous(), q, k, v, doc_ids, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None


static_attention_op.register_autograd(_backward, setup_context=_setup)


def run_static_attention(q, k, v, layout, *, kernel: str, contain: bool) -> torch.Tensor:
    """The op for a graph-ready ``ShardLayout`` (``layout.static_shapes``), after validation and agreement."""
    return torch.ops.cp_linear.blockdiag_attention_static(
        q, k, v, layout.doc_ids_tensor(q.device), layout.shard_start, layout.group_name or "", 0.0, kernel, contain)


__all__ = ["QUERY_BLOCK", "run_static_attention", "static_attention_op"]
