"""Chunkwise CP for GDP in the zig-zag layout (``cp_linear.zigzag``) over torch.distributed.

Rank r holds chunks r and 2·cp−1−r (local order), each a *virtual shard* of a contiguous 2·cp-way
split with its own ``PackedSequenceCPMetadata`` (``ZigzagCPMetadata.shards``). The backend runs once
per chunk, unchanged; the exchange is the contiguous layout's over 2·cp virtual shards::

    rank r:  prepare chunk r, prepare chunk 2cp-1-r   (zero incoming state)
             -> agreement -> one all-gather of the pair [2, H, K, V + K]    -> [cp, 2, ...]
             -> sequence order (cp_linear.zigzag.gathered_chunk_order)             -> [s_0, ..., s_{2cp-1}]
             -> per chunk c: apply with [s_start .. s_{c-1}]                 (start from its metadata)

The backward is the same with ``[gamma | M^T]`` and the following slices ``[c + 1, stop)``. The fold
itself is the backends' (``cp_linear.summary``), as in the contiguous layout. Bytes: each rank sends
two summaries and receives ``2·cp − 2``, twice the contiguous all-gather (docs/cp_options.md).
Supported: the all-gather exchange with ``check_inputs=True``, packed ids or batch rows; not (yet)
sequence states, the scan exchange or containment (``check_inputs=False``): those raise a ValueError
on every rank before any collective (``cp_linear.zigzag.zigzag_gdp_option_error``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist

from cp_linear.protocol import CPSavedContext
from cp_linear.validation import GDP_VALUE_CHECKS
from torch_api.gdp.types import GDPInputGradients, GDPInputs, float32_region
from torch_api.gdp.validation import dtype_code, gdp_value_flags, nonfinite_flags


@dataclass(frozen=True)
class ZigzagCall:
    """One zig-zag GDP call: ``ranges`` per local chunk ``(chunk, preceding_start, following_stop)``
    (``cp_linear.zigzag.virtual_rank_ranges``), ``cu_seqlens`` per chunk (None for batch rows) and
    ``order`` int64 [2·cp] (``cp_linear.zigzag.gathered_chunk_order``)."""

    backend: object
    group: dist.ProcessGroup
    ranges: tuple[tuple[int, int, int], ...]
    order: torch.Tensor
    scale: float
    num_householder: int
    use_qk_l2norm_in_kernel: bool
    cu_seqlens: tuple[torch.Tensor | None, ...]
    error: str | None
    signature: tuple[int, ...]


def _map_summary(fn, *summaries):
    """Apply ``fn`` to the tensors of packed summaries (tensors) or field-wise to unpacked ones."""
    first = summaries[0]
    if isinstance(first, torch.Tensor):
        return fn(*summaries)
    return replace(first, **{f.name: fn(*(getattr(s, f.name) for s in summaries)) for f in fields(first)})


def _run_chunks(call: ZigzagCall, prepare, apply, pieces, slices, *, what: str, signature: list[int], value_flags,
                value_checks, summary_error) -> list:
    """prepare each chunk -> agreement -> all-gather of the pair -> sequence order -> slice -> apply."""
    from torch_api.gdp.cp import _agree, _all_gather_summary, _slice_summary, _summary_signature

    error, cause, prepared = call.error, None, []
    for piece in pieces if error is None else ():
        try:
            summary, local = prepare(piece)
        except Exception as err:  # reported on every rank instead of leaving the others in the all-gather
            error, cause = f"{type(call.backend).__name__} prepare ({what}) raised {type(err).__name__}: {err}", err
            break
        error = summary_error(summary)
        if error:
            break
        prepared.append((summary, local))
    if error is None:
        signature = signature + _summary_signature(prepared[0][0])
    _agree(call.group, error, signature, what=what, cause=cause, value_flags=value_flags, value_checks=value_checks)
    stacked = _map_summary(lambda *parts: torch.stack(parts), *(summary for summary, _ in prepared))
    gathered = _all_gather_summary(stacked, call.group)  # [cp, 2, ...], rank-major
    ordered = _map_summary(lambda x: x.flatten(0, 1).index_select(0, call.order.to(x.device)), gathered)
    return [apply(local, _slice_summary(ordered, chunk_slice)) for (_, local), chunk_slice in zip(prepared, slices)]


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 2·C·m, ...] -> the two chunks' [B, C·m, ...] (m = 1, or n_h for k, v, beta)."""
    half = x.shape[1] // 2
    return x[:, :half], x[:, half:]


class ZigzagGDP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: ZigzagCall, q, k, v, g, beta):
        from torch_api.gdp.cp import _summary_error

        pieces = [GDPInputs(*parts, call.scale, call.num_householder, call.use_qk_l2norm_in_kernel, cu)
                  for *parts, cu in zip(*map(_halves, (q, k, v, g, beta)), call.cu_seqlens)]
        batch, _, heads, key_dim = q.shape
        lead = (heads, key_dim) if call.cu_seqlens[0] is not None else (batch, heads, key_dim)
        flags = gdp_value_flags(q, k, v, g, beta) if call.error is None else None
        with float32_region(q.device):
            results = _run_chunks(
                call, call.backend.cp_forward_prepare, call.backend.cp_forward_apply, pieces,
                [slice(start, chunk) for chunk, start, _ in call.ranges],
                what="GDP context-parallel forward", signature=list(call.signature), value_flags=flags,
                value_checks=GDP_VALUE_CHECKS,
                summary_error=lambda s: _summary_error(s, f"{type(call.backend).__name__} forward summary",
                                                       lead=lead, value_dim=v.shape[-1]))
        ctx.call = call
        ctx.saved = [(len(saved.tensors), saved.metadata) for _, saved in results]
        ctx.save_for_backward(*(t for _, saved in results for t in saved.tensors))
        return torch.cat([output for output, _ in results], dim=1)

    @staticmethod
    def backward(ctx, output_grad):
        from torch_api.gdp.cp import _OUTPUT_GRAD_CHECKS, _summary_error

        call, tensors = ctx.call, list(ctx.saved_tensors)
        saved, start = [], 0
        for count, metadata in ctx.saved:
            saved.append(CPSavedContext(tuple(tensors[start:start + count]), metadata))
            start += count
        output_grad = output_grad.contiguous()
        signature = [*output_grad.shape, dtype_code(output_grad.dtype), 1]
        with float32_region(output_grad.device):
            grads = _run_chunks(
                call, lambda piece: call.backend.cp_backward_prepare(*piece), call.backend.cp_backward_apply,
                list(zip(_halves(output_grad), saved)), [slice(chunk + 1, stop) for chunk, _, stop in call.ranges],
                what="GDP context-parallel backward", signature=signature,
                value_flags=nonfinite_flags(output_grad), value_checks=_OUTPUT_GRAD_CHECKS,
                summary_error=lambda s: _summary_error(s, f"{type(call.backend).__name__} backward summary",
                                                       value_dim=output_grad.shape[-1]))
        joined = GDPInputGradients(*(torch.cat(parts, dim=1) for parts in zip(*(grad[:5] for grad in grads))))
        return None, joined.dq, joined.dk, joined.dv, joined.dg, joined.dbeta


__all__ = ["ZigzagCall", "ZigzagGDP"]
