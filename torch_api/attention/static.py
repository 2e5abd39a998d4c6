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
             BlockMask on the device every call, from the same rule (``doc_causal_block_mask``)

Padding rows output exactly 0 and get zero gradient, as in ``doc_causal_attention``. ``contain``
(values unchecked): the kernel runs on sanitised q/k/v and a real query is NaN exactly when its own
q or a key/value it may read is non-finite (``cp_linear.validation``). One device: ``group_name``
"" (no exchange, ``query_start`` 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cp_linear.validation import any_in_ranges, nonfinite_rows, sanitize
from torch_api import _prefix_counts  # noqa: F401  (the flag counts as a custom op: compiled steps)
from torch_api._poison import poison
from torch_api.gdp.library import _autograd_inside, _functorch_inside

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


def _ordered_blocks(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [rows, cols] -> BlockMask's (counts int32 [1, 1, rows], indices int32 [1, 1, rows, cols]);
    the stable descending sort puts the selected columns first, in ascending order (as flex does)."""
    counts = tiles.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(tiles.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts.view(1, 1, -1), indices.view(1, 1, *tiles.shape)


def doc_causal_block_mask(doc_ids: torch.Tensor, query_start: int, queries: int, block: int):
    """The flex BlockMask of the doc-causal rule for queries [query_start, query_start + queries) over
    the keys [0, T) of doc_ids int64 [T], built with plain tensor ops on the device.

    Not ``create_block_mask``: its vmap fails inside this op when a compiled graph calls it (functorch's
    dispatch keys are excluded there, issue 15), and it builds a dense [queries, T] mask. Each document
    is one run of equal ids (``cp_linear.plan.validate_doc_ids``), so query p reads exactly the keys
    [run start(p), p]: a tile is read when some row reads some key of it, full when every row reads all
    of its keys (complete tiles only); the mask_mod applies the rule itself inside the partial tiles.
    """
    from torch.nn.attention.flex_attention import BlockMask

    keys = doc_ids.shape[0]
    q_blocks, k_blocks = -(-queries // block), -(-keys // block)
    rows = torch.arange(q_blocks * block, device=doc_ids.device)
    position = torch.clamp(rows, max=queries - 1) + query_start  # global; rows past the end read nothing
    real = (rows < queries) & (doc_ids[position] > 0)
    start = _run_starts(doc_ids)[position]
    first_key = torch.arange(k_blocks, device=doc_ids.device) * block
    last_key = torch.clamp(first_key + block, max=keys) - 1
    reads_some = real[:, None] & (start[:, None] <= last_key) & (position[:, None] >= first_key)
    reads_all = (real[:, None] & (start[:, None] <= first_key) & (position[:, None] >= last_key)
                 & (last_key - first_key + 1 == block))
    some = reads_some.view(q_blocks, block, k_blocks).any(dim=1)
    full = reads_all.view(q_blocks, block, k_blocks).all(dim=1)
    partial = some & ~full

    query_doc = doc_ids[query_start:query_start + queries]
    query_pos = torch.arange(query_start, query_start + queries, device=doc_ids.device)

    def doc_causal(b, h, q_idx, kv_idx):  # indexes precomputed tensors only
        return (query_doc[q_idx] == doc_ids[kv_idx]) & (kv_idx <= query_pos[q_idx]) & (query_doc[q_idx] > 0)

    # the constructor, not from_kv_blocks: that derives the query-side tables with a vmap
    kv_num_blocks, kv_indices = _ordered_blocks(partial)
    full_kv_num_blocks, full_kv_indices = _ordered_blocks(full)
    q_num_blocks, q_indices = _ordered_blocks(partial.transpose(0, 1))
    full_q_num_blocks, full_q_indices = _ordered_blocks(full.transpose(0, 1))
    return BlockMask(seq_lengths=(queries, keys), kv_num_blocks=kv_num_blocks, kv_indices=kv_indices,
                     full_kv_num_blocks=full_kv_num_blocks, full_kv_indices=full_kv_indices,
                     q_num_blocks=q_num_blocks, q_indices=q_indices, full_q_num_blocks=full_q_num_blocks,
                     full_q_indices=full_q_indices, BLOCK_SIZE=(block, block), mask_mod=doc_causal)


def _flex(q, k, v, doc_ids, query_start, scale):
    from torch_api.attention.kernel import FLEX_BLOCK, _flex_fn

    block_mask = doc_causal_block_mask(doc_ids, query_start, q.shape[1], FLEX_BLOCK)
    # eager flex_attention (CPU) evaluates the mask_mod under vmap: functorch's keys back on for it
    with _functorch_inside():
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


__all__ = ["QUERY_BLOCK", "doc_causal_block_mask", "run_static_attention", "static_attention_op"]
