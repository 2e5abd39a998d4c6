"""Chunkwise context parallelism for Gated DeltaProduct over torch.distributed.

Glossary (docs/design.md §2)
  shard      the contiguous slice of the sequence one rank holds (L tokens)
  summary    the affine map of a shard: forward ``[E | M]`` (S_out = M S_in + E), backward
             ``[gamma | M^T]`` (dS_in = M^T dS_out + gamma); float32 [H, K, V + K] for a packed
             batch, [B, H, K, V + K] when each batch row is one sequence
  preceding  gathered forward summaries of ranks [preceding_rank_start, rank): folded ascending
             into this rank's incoming state
  following  gathered backward summaries of ranks [rank + 1, following_rank_stop): folded
             descending into this rank's outgoing state-gradient

One step, per direction::

    rank r:  prepare (zero incoming state)  ->  all-gather summaries  ->  slice  ->  apply
               summary_r --------------------> [s_0, s_1, ..., s_{cp-1}] -> [s_start .. s_{r-1}]

Bad input is caught before the first collective: each rank validates locally (and runs its
``prepare``), then one small fixed-size all-gather (``agree_or_raise``) makes every rank raise the
same ValueError if any rank failed or the ranks disagree on shapes, dtypes, flags or the packed ids
(their fingerprint travels in the header). With ``check_inputs=False`` non-finite values are
contained rather than reported (``torch_api.gdp.isolation``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch
import torch.distributed as dist

from cp_linear.plan import PackedSequenceCPMetadata, build_packed_sequence_cp_metadata, sequence_state_routing
from cp_linear.protocol import CPForwardResult, CPSavedContext
from cp_linear.zigzag import (
    LAYOUTS,
    ZigzagCPMetadata,
    build_zigzag_cp_metadata,
    gathered_chunk_order,
    virtual_rank_ranges,
    zigzag_gdp_option_error,
)
from cp_linear.summary import (
    CPBackwardPackedSummary,
    CPBackwardUnpackedSummary,
    CPForwardPackedSummary,
    CPForwardUnpackedSummary,
    validate_packed_summary,
)
from cp_linear.validation import GDP_VALUE_CHECKS, NONFINITE
from torch_api._poison import poison
from torch_api._dist import agree_or_raise, all_gather_single, group_rank_and_size, resolve_group
from cp_linear.summary_exchange import ScanSchedule, resolve_summary_exchange, scan_schedule
from torch_api.gdp.summary_exchange import scan_exchange
from torch_api.gdp.isolation import (
    contained_inputs,
    incoming_bad_and_clean,
    poison_summary,
    sequence_start_index,
    token_poison,
    trailing_bad,
)
from torch_api.gdp.types import GDPInputGradients, GDPInputs, float32_region, needs_backward
from torch_api.gdp.validation import (
    dtype_code,
    float_bits,
    gdp_input_error,
    gdp_value_flags,
    initial_state_error,
    nonfinite_flags,
)


_OUTPUT_GRAD_CHECKS = (("output_grad", NONFINITE + " in output_grad"),)
_INITIAL_STATE_CHECKS = (("initial_state", NONFINITE + " in initial_state"),)
_PACKED_FORMS = (CPForwardPackedSummary, CPBackwardPackedSummary)
_UNPACKED_FORMS = (CPForwardUnpackedSummary, CPBackwardUnpackedSummary)


# --------------------------------------------------------------------------- summaries on the wire


def _summary_tensors(summary) -> tuple[torch.Tensor, ...]:
    """The tensors a summary travels as: one (packed or bare tensor) or two (unpacked)."""
    if isinstance(summary, torch.Tensor):
        return (summary,)
    if isinstance(summary, _PACKED_FORMS + _UNPACKED_FORMS):
        return tuple(getattr(summary, f.name) for f in fields(summary))
    raise TypeError(f"a backend returned a summary of type {type(summary).__name__}; expected a torch.Tensor "
                    "or a cp_linear.summary packed / unpacked summary")


def _summary_error(summary, what: str, *, lead: tuple[int, ...] | None = None, value_dim: int | None = None
                   ) -> str | None:
    """Float32, contiguous, [..., H, K, V + K] (packed) or matching transition / update parts (unpacked);
    ``lead`` = the expected [..., H, K] and ``value_dim`` = V when known."""
    try:
        tensors = _summary_tensors(summary)
    except TypeError as err:
        return str(err)
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            return f"{what}: expected torch tensors; received {type(tensor).__name__}"
    if len(tensors) == 1:
        try:
            key_dim = None if lead is None else lead[-1]
            validate_packed_summary(tensors[0], name=what, key_dim=key_dim, value_dim=value_dim)
        except ValueError as err:
            return str(err)
    else:
        for tensor in tensors:
            if tensor.dtype != torch.float32:
                return f"{what} must be float32; received {tensor.dtype}"
            if not tensor.is_contiguous():
                return f"{what} must be contiguous"
            if tensor.dim() < 3:
                return f"{what} must have shape [..., H, K, ...]; received {tuple(tensor.shape)}"
        transition, other = tensors
        if (transition.shape[-1] != transition.shape[-2] or transition.shape[:-1] != other.shape[:-1]
                or (value_dim is not None and other.shape[-1] != value_dim)):
            return (f"{what}: transition must be [..., H, K, K] beside [..., H, K, V = {value_dim}]; received "
                    f"{tuple(transition.shape)} and {tuple(other.shape)}")
    if lead is not None and tuple(tensors[0].shape[:-1]) != lead:
        return f"{what}: expected shape {lead} + [last dim]; received {tuple(tensors[0].shape)}"
    return None


def _summary_signature(summary) -> list[int]:
    tensors = _summary_tensors(summary)
    return [len(tensors), tensors[0].dim(), *tensors[0].shape, tensors[-1].shape[-1]]


def _all_gather_summary(summary, group: dist.ProcessGroup):
    """Stack every rank's summary along a new leading axis: one all-gather, or a coalesced pair."""
    tensors = _summary_tensors(summary)
    world = dist.get_world_size(group)
    # flat buffers: gloo accepts only the concatenated (not the stacked) output form
    flat = [t.new_empty(world * t.numel()) for t in tensors]
    if len(tensors) == 1:
        all_gather_single(flat[0], tensors[0].view(-1), group=group)
    else:  # unpacked: two all-gathers in one coalesced launch, no packing copy
        with dist._coalescing_manager(group, async_ops=True) as coalesced:
            for out, tensor in zip(flat, tensors):
                all_gather_single(out, tensor.view(-1), group=group)
        coalesced.wait()
    gathered = [out.view(world, *t.shape) for out, t in zip(flat, tensors)]
    if isinstance(summary, torch.Tensor):
        return gathered[0]
    return replace(summary, **{f.name: out for f, out in zip(fields(summary), gathered)})


def _slice_summary(gathered, ranks: slice):
    if isinstance(gathered, torch.Tensor):
        return gathered[ranks]
    return replace(gathered, **{f.name: getattr(gathered, f.name)[ranks] for f in fields(gathered)})


def _rank_slice(ranks, world: int, name: str) -> slice:
    if isinstance(ranks, tuple) and len(ranks) == 2:
        ranks = slice(*ranks)
    if not isinstance(ranks, slice) or ranks.step not in (None, 1):
        raise ValueError(f"{name} must be a slice (or (start, stop)) of ranks; received {ranks!r}")
    start, stop = ranks.start or 0, world if ranks.stop is None else ranks.stop
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= world):
        raise ValueError(f"{name} must lie within [0, {world}]; received {ranks!r}")
    return slice(start, stop)


def _agree(group, error: str | None, signature: list[int], *, what: str, cause: BaseException | None,
           value_flags: torch.Tensor | None = None, value_checks=(), agreed: bool = False) -> None:
    """The fixed-size agreement header; it travels on every call, whatever ``check_inputs`` says, so
    ranks whose flags differ still meet in the same collective (and disagree there). ``agreed``: a
    wider agreement covered this call (the layers under a model), so only a local error raises."""
    if agreed:
        if error:
            raise ValueError(f"{what} rejected: {error}") from cause
        return
    try:
        agree_or_raise(group, error, signature, what=what, value_flags=value_flags, value_checks=value_checks)
    except ValueError as err:
        raise err from cause


# --------------------------------------------------------------------------- the two directions


def _input_signature(inputs: GDPInputs, check_inputs: bool) -> list[int]:
    return [*inputs.q.shape, inputs.v.shape[-1], inputs.num_householder, dtype_code(inputs.q.dtype),
            dtype_code(inputs.g.dtype), dtype_code(inputs.beta.dtype), int(bool(inputs.use_qk_l2norm_in_kernel)),
            float_bits(inputs.scale), int(inputs.cu_seqlens is not None), int(bool(check_inputs))]


def _forward(backend, inputs: GDPInputs, group, preceding_slice: slice, *, check_inputs: bool,
             error: str | None, signature: list[int], trailing_bad: torch.Tensor | None = None,
             agreed: bool = False, schedule: ScanSchedule | None = None):
    """prepare -> agreement -> all-gather -> slice -> apply. Returns (CPForwardResult, incoming_bad).

    ``schedule``: exchange by the log-depth scan (``torch_api.gdp.summary_exchange``) instead of the
    all-gather; the backend then receives one folded summary.

    ``trailing_bad`` (isolation, ``torch_api.gdp.isolation``): bool [B or 1, H] heads whose trailing
    fragment is poisoned; their summary travels as NaN, and ``incoming_bad`` says which heads of
    this rank's incoming state were poisoned (None without isolation).
    """
    cause = summary = local = flags = None
    value_checks = GDP_VALUE_CHECKS
    if error is None and check_inputs:
        flags = gdp_value_flags(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)
        if inputs.initial_state is not None:  # every row is local on some rank, which flags it
            flags = torch.cat([flags, nonfinite_flags(inputs.initial_state)])
            value_checks = value_checks + _INITIAL_STATE_CHECKS
    if error is None:
        try:
            summary, local = backend.cp_forward_prepare(inputs)
        except Exception as err:  # reported on every rank instead of leaving the others in the all-gather
            error, cause = f"{type(backend).__name__}.cp_forward_prepare raised {type(err).__name__}: {err}", err
    if error is None:
        batch, _, heads, key_dim = inputs.q.shape
        lead = (heads, key_dim) if inputs.cu_seqlens is not None else (batch, heads, key_dim)
        error = _summary_error(summary, f"{type(backend).__name__} forward summary", lead=lead,
                               value_dim=inputs.v.shape[-1])
    if error is None:
        signature = signature + _summary_signature(summary)
        if trailing_bad is not None:
            summary = poison_summary(summary, trailing_bad)
    _agree(group, error, signature, what="GDP context-parallel forward", cause=cause, value_flags=flags,
           value_checks=value_checks, agreed=agreed)
    if schedule is None:
        preceding = _slice_summary(_all_gather_summary(summary, group), preceding_slice)
    else:
        preceding = scan_exchange(summary, group, schedule)
    incoming_bad = None
    if trailing_bad is not None:
        incoming_bad, preceding = incoming_bad_and_clean(preceding)
    return backend.cp_forward_apply(local, preceding), incoming_bad


def chunkwise_cp_forward(backend, inputs: GDPInputs, cp_group, preceding_slice, *,
                         check_inputs: bool = True) -> CPForwardResult:
    """Forward of one rank: ``backend.cp_forward_prepare`` -> all-gather -> slice -> ``cp_forward_apply``.

    inputs: this rank's shard (``GDPInputs``, local ``cu_seqlens`` for a packed batch);
    preceding_slice: ``slice(preceding_rank_start, rank)`` (``slice(0, rank)`` for rows).
    One small agreement collective runs before the all-gather on every call; ``check_inputs`` (agreed
    across ranks) adds the value checks (NaN/Inf, g > 0, beta outside [0, 2]) to it. This protocol-level
    function does not contain non-finite values (``gdp_chunkwise_context_parallel`` does).
    Returns ``CPForwardResult(output, saved_context)``.
    """
    group = resolve_group(cp_group)
    preceding_slice = _rank_slice(preceding_slice, dist.get_world_size(group), "preceding_slice")
    error = gdp_input_error(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta,
                            num_householder=inputs.num_householder, scale=inputs.scale, cu_seqlens=inputs.cu_seqlens)
    signature = _input_signature(inputs, check_inputs) if error is None else []
    result, _ = _forward(backend, inputs, group, preceding_slice, check_inputs=check_inputs, error=error,
                         signature=signature)
    return result


def chunkwise_cp_backward(backend, output_grad: torch.Tensor, saved_context: CPSavedContext, cp_group,
                          following_slice, *, check_inputs: bool = True, agreed: bool = False,
                          final_state_grad: torch.Tensor | None = None,
                          schedule: ScanSchedule | None = None) -> GDPInputGradients:
    """Backward of one rank: ``cp_backward_prepare`` -> all-gather -> slice -> ``cp_backward_apply``.

    output_grad [B, T, H, V]; following_slice: ``slice(rank + 1, following_rank_stop)``
    (``slice(rank + 1, cp_size)`` for rows). One agreement collective runs before the all-gather
    (``check_inputs`` adds the NaN/Inf check of ``output_grad``). ``final_state_grad`` (local
    sequences' final states, when the forward asked for them) goes to the backend with
    ``output_grad``; ``schedule``: the scan exchange instead of the all-gather. Returns the input
    gradients (``dinitial_state`` for the local initial states when the forward had them).
    """
    group = resolve_group(cp_group)
    following_slice = _rank_slice(following_slice, dist.get_world_size(group), "following_slice")
    error = cause = summary = local = flags = None
    if not isinstance(output_grad, torch.Tensor):
        error = f"output_grad must be a torch.Tensor; received {type(output_grad).__name__}"
    elif check_inputs:
        flags = nonfinite_flags(output_grad)
    if error is None:
        try:
            grads_in = output_grad if final_state_grad is None else (output_grad, final_state_grad)
            summary, local = backend.cp_backward_prepare(grads_in, saved_context)
        except Exception as err:
            error, cause = f"{type(backend).__name__}.cp_backward_prepare raised {type(err).__name__}: {err}", err
    if error is None:
        error = _summary_error(summary, f"{type(backend).__name__} backward summary",
                               value_dim=output_grad.shape[-1])
    signature = [] if error else [*output_grad.shape, dtype_code(output_grad.dtype), int(bool(check_inputs)),
                                  *_summary_signature(summary)]
    _agree(group, error, signature, what="GDP context-parallel backward", cause=cause, value_flags=flags,
           value_checks=_OUTPUT_GRAD_CHECKS, agreed=agreed)
    if schedule is None:
        following = _slice_summary(_all_gather_summary(summary, group), following_slice)
    else:
        following = scan_exchange(summary, group, schedule)
    return backend.cp_backward_apply(local, following)


# --------------------------------------------------------------------------- autograd and the public op


@dataclass(frozen=True)
class _CPCall:
    backend: object
    group: dist.ProcessGroup
    preceding: slice
    following: slice
    scale: float
    num_householder: int
    use_qk_l2norm_in_kernel: bool
    cu_seqlens: torch.Tensor | None
    check_inputs: bool
    error: str | None
    signature: tuple[int, ...]
    agreed: bool = False  # a wider agreement covered this call: no header of its own
    output_final_state: bool = False  # the backend returns the local sequences' final states too
    forward_schedule: ScanSchedule | None = None  # None: the summaries travel by all-gather
    backward_schedule: ScanSchedule | None = None


class _ContextParallelGDP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _CPCall, trailing_bad, token_flags, q, k, v, g, beta, local_initial):
        """-> (o, local final states [n, H, K, V] or [0], incoming_bad); ``local_initial``: the initial
        states of the local sequences or None (``_local_initial_states``); ``token_flags``: None, or the
        containment's (state_bad, read_bad) for a backend that zeroes flagged rows (``GDPInputs.token_flags``:
        its saved context keeps them for the backward)."""
        inputs = GDPInputs(q, k, v, g, beta, call.scale, call.num_householder, call.use_qk_l2norm_in_kernel,
                           call.cu_seqlens, local_initial, call.output_final_state, token_flags=token_flags)
        with float32_region(q.device):
            (output, saved), incoming_bad = _forward(
                call.backend, inputs, call.group, call.preceding, check_inputs=call.check_inputs, error=call.error,
                signature=list(call.signature), trailing_bad=trailing_bad, agreed=call.agreed,
                schedule=call.forward_schedule)
        output, final = output if call.output_final_state else (output, output.new_zeros(0))
        ctx.call = call
        ctx.saved_metadata = saved.metadata
        ctx.initial_dtype = None if local_initial is None else local_initial.dtype
        ctx.save_for_backward(*saved.tensors)
        if incoming_bad is None:
            incoming_bad = torch.zeros(0, dtype=torch.bool, device=output.device)
        ctx.mark_non_differentiable(incoming_bad)
        return output, final, incoming_bad

    @staticmethod
    def backward(ctx, output_grad, final_grad, _incoming_bad_grad):
        call = ctx.call
        saved = CPSavedContext(tuple(ctx.saved_tensors), ctx.saved_metadata)
        with float32_region(output_grad.device):
            grads = chunkwise_cp_backward(call.backend, output_grad, saved, call.group, call.following,
                                          check_inputs=call.check_inputs, agreed=call.agreed,
                                          final_state_grad=final_grad if call.output_final_state else None,
                                          schedule=call.backward_schedule)
        initial_grad = None
        if ctx.initial_dtype is not None:
            initial_grad = grads.dinitial_state.to(ctx.initial_dtype)
        return None, None, None, grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, initial_grad


def _metadata_error(metadata, rank: int, world: int, q: torch.Tensor) -> str | None:
    if not isinstance(metadata, PackedSequenceCPMetadata):
        return f"metadata must be a PackedSequenceCPMetadata; received {type(metadata).__name__}"
    error = _metadata_rank_error(metadata, rank, world, q)
    if error:
        return error
    cu = np.asarray(metadata.local_cu_seqlens)
    if cu.ndim != 1 or cu.shape[0] < 2 or cu[0] != 0 or cu[-1] != q.shape[1] or np.any(np.diff(cu) <= 0):
        return f"metadata.local_cu_seqlens must rise strictly from 0 to {q.shape[1]}; received {cu.tolist()}"
    if not 0 <= metadata.preceding_rank_start <= rank < metadata.following_rank_stop <= world:
        return (f"metadata rank range [{metadata.preceding_rank_start}, {metadata.following_rank_stop}) "
                f"must contain rank {rank} within [0, {world})")
    return None


class _EagerCPOp(torch.autograd.Function):
    """``cp_linear::gdp_cp_forward`` / ``gdp_cp_backward`` in eager mode: the ops' bodies
    (``torch_api.gdp.library.cp_forward`` / ``cp_backward``), the backend's saved context kept as is."""

    @staticmethod
    def forward(ctx, backend, group_name, rank_range, trailing_bad, options, q, k, v, g, beta):
        from torch_api.gdp.library import _group, cp_forward

        group = _group(group_name)
        output, saved, incoming_bad = cp_forward(backend, group, GDPInputs(q, k, v, g, beta, **options), rank_range,
                                                 trailing_bad)
        ctx.backend, ctx.group, ctx.rank_range, ctx.saved_metadata = backend, group, rank_range, saved.metadata
        ctx.input_dtypes = tuple(x.dtype for x in (q, k, v, g, beta))
        ctx.save_for_backward(*saved.tensors)
        ctx.mark_non_differentiable(incoming_bad)
        return output, incoming_bad

    @staticmethod
    def backward(ctx, output_grad, _incoming_bad_grad):
        from torch_api.gdp.library import cp_backward, output_grad_or_zeros

        saved = CPSavedContext(tuple(ctx.saved_tensors), ctx.saved_metadata)
        output_grad = output_grad_or_zeros(output_grad, saved.tensors[0], saved.tensors[2])  # q, v
        grads = cp_backward(ctx.backend, ctx.group, output_grad, saved, ctx.rank_range)
        cast = [x if x.dtype == dtype else x.to(dtype) for x, dtype in
                zip((grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta), ctx.input_dtypes)]
        return (None, None, None, None, None, *cast)


def run_cp_op(q, k, v, g, beta, *, cu_seqlens, rank_range, group_name: str, backend, scale: float, num_householder: int,
              use_qk_l2norm_in_kernel: bool, contain: bool) -> torch.Tensor:
    """The CP op after validation and agreement: ``cp_linear::gdp_cp_forward`` (collectives inside,
    autograd registered; ``torch.compile`` traces it, no host read, no header). The layers run it for a
    call that a model agreement covered, with their checks off. rank_range int [2] =
    (preceding_rank_start, following_rank_stop), on any device (the layers pass a cached device
    tensor). contain: non-finite inputs are contained as with ``check_inputs=False``
    (``torch_api.gdp.isolation``: sanitised inputs, or raw ones with token flags for a backend that zeroes
    flagged rows; poisoned summaries and outputs). In eager mode
    the op's bodies run through ``_EagerCPOp`` (the same numbers without the custom op's dispatch
    layers, as for the one-device op)."""
    from torch_api.gdp.library import backend_name

    token_flags = None
    if contain:
        # the raw read_bad flags (a backend that zeroes flagged rows stores NaN there): the poison entering from
        # earlier ranks is known only after the exchange, so the select below stays
        state_bad, read_bad, (q, k, v, g, beta), token_flags = contained_inputs(q, k, v, g, beta, num_householder,
                                                                                backend=backend)
        start = sequence_start_index(q.shape[1], cu_seqlens, q.device)
        trailing = trailing_bad(state_bad, start)
    else:
        trailing = torch.zeros(0, dtype=torch.bool, device=q.device)
    save_for_backward = needs_backward(q, k, v, g, beta)
    if torch.compiler.is_compiling():
        output, *_, incoming_bad = torch.ops.cp_linear.gdp_cp_forward(
            q, k, v, g, beta, cu_seqlens, rank_range, trailing, scale, num_householder, use_qk_l2norm_in_kernel,
            backend_name(backend), group_name, save_for_backward, *(token_flags or (None, None)))
    else:
        options = dict(scale=scale, num_householder=num_householder, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       cu_seqlens=cu_seqlens, save_for_backward=save_for_backward, token_flags=token_flags)
        output, incoming_bad = _EagerCPOp.apply(backend, group_name, rank_range, trailing, options, q, k, v, g, beta)
    if contain:
        output = poison(output, token_poison(state_bad, read_bad, start, incoming_bad)[..., None])
    return output


def gdp_chunkwise_context_parallel(q, k, v, g, beta, *, cp_group, global_seq_idx=None,
                                   metadata: PackedSequenceCPMetadata | None = None, scale=None, num_householder=1,
                                   use_qk_l2norm_in_kernel=False, backend=None, check_inputs: bool = True,
                                   initial_state=None, output_final_state: bool = False,
                                   summary_exchange: str = "all_gather", layout: str = "contiguous"):
    """GDP over a sequence split across the ranks of ``cp_group``; differentiable.

    Local shards in, local output out (docs/design.md §2 layouts):
      q [B, L, H, K], k [B, L*n_h, H, K], v [B, L*n_h, H, V], g [B, L, H] (None: no gate),
      beta [B, L*n_h, H] -> o [B, L, H, V] in q's dtype; gradients flow to q, k, v, g and beta.
    Packed batch: B = 1 and either ``global_seq_idx`` (int [1, T], the replicated ids, as in
    ``jax_api.gdp_chunkwise_context_parallel``) or the ``metadata`` built from them once per step
    (``build_packed_sequence_cp_metadata(global_seq_idx, rank, cp_size)``). Without either, every
    batch row is one sequence spanning all ranks in order.
    cp_group: ProcessGroup or 1-D DeviceMesh (gloo or NCCL).

    Sequence states (docs/cp_options.md), in the one-device op's layout [N, H, K, V]: sequence n is
    the n-th run of equal ids (batch row n without ids). ``initial_state`` float [N, H, K, V] (None:
    zeros), the same on every rank, enters each sequence where it starts. With
    ``output_final_state=True`` the op returns ``(o, final_state)``: float32 [N, H, K, V] whose row n
    is sequence n's final state on the rank holding its last token and zeros on every other rank, so
    that the sum over the group is the one-device final state. Gradients follow the same rule: each
    rank's ``initial_state.grad`` holds the rows of the sequences that start on it (zeros elsewhere);
    summed over the group (as weight gradients are) they give the one-device gradient.

    summary_exchange: "all_gather" (one collective, cp summaries of memory), "scan" (a log-depth
    prefix fold over point-to-point sends, ``torch_api.gdp.summary_exchange``), or "auto" (scan from
    ``SCAN_MIN_WORLD`` ranks); same results up to float32 reassociation.

    layout: "contiguous" (rank r holds global tokens [r·L, (r+1)·L)) or "zigzag" (rank r holds chunks
    r and 2·cp−1−r of 2·cp equal chunks, in that order: ``cp_linear.zigzag``, load-balanced causal
    attention). Under "zigzag" the ids stay in global (sequence) order and ``metadata`` is a
    ``cp_linear.zigzag.ZigzagCPMetadata`` (``build_zigzag_cp_metadata``); sequence states, the scan
    exchange and ``check_inputs=False`` are not supported there (ValueError on every rank).

    check_inputs: the value checks (NaN/Inf, g > 0, beta outside [0, 2] in the inputs, NaN/Inf in
    initial_state; NaN/Inf in the output gradient). Whatever it says, one small agreement collective
    per direction makes every rank raise the same ValueError for any local failure (bad shapes,
    metadata for another rank or cp_size or edited after it was built, K > 256, a backend error, a
    non-float32 summary, an initial_state of the wrong shape, dtype or device) or any cross-rank
    disagreement (shapes, dtypes, flags, check_inputs itself, the packed ids' fingerprint).
    With False, non-finite inputs are contained instead of reported: outputs that depend on them are
    NaN, every other output is exact (``torch_api.gdp.isolation``; a non-finite initial_state is not
    contained). docs/failure_modes.md lists every check and its cost. backend: an instance, or None /
    "auto" (the CuTeDSL kernels on a Hopper GPU for a configuration they take, else
    ``TorchGDPBackend``), "reference", "cutedsl" (``torch_api.gdp.ops.resolve_backend``). The layers
    run a call that a model agreement covered, with checks off, as the ``cp_linear::gdp_cp_forward``
    custom op instead (``run_cp_op``).
    """
    return context_parallel_gdp(q, k, v, g, beta, cp_group=cp_group, global_seq_idx=global_seq_idx, metadata=metadata,
                                scale=scale, num_householder=num_householder,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, backend=backend,
                                check_inputs=check_inputs, initial_state=initial_state,
                                output_final_state=output_final_state, summary_exchange=summary_exchange,
                                layout=layout)


def _zigzag_metadata_error(metadata, rank: int, world: int, q: torch.Tensor) -> str | None:
    if not isinstance(metadata, ZigzagCPMetadata):
        return (f"layout='zigzag' needs a cp_linear.zigzag.ZigzagCPMetadata (build_zigzag_cp_metadata); received "
                f"{type(metadata).__name__}")
    return _metadata_rank_error(metadata, rank, world, q)


def _metadata_rank_error(metadata, rank: int, world: int, q: torch.Tensor) -> str | None:
    """Checks both layouts' metadata share: built cleanly, for this rank, for q's packed shape."""
    if metadata.error:
        return metadata.error
    if (metadata.cp_size, metadata.cp_rank) != (world, rank):
        return (f"metadata was built for cp_rank {metadata.cp_rank} of cp_size {metadata.cp_size}; "
                f"this is rank {rank} of {world}")
    if q.shape[0] != 1:
        return f"a packed batch (metadata given) needs B = 1; received B = {q.shape[0]}"
    if metadata.local_len != q.shape[1]:
        return f"metadata describes a local length of {metadata.local_len} tokens; q holds {q.shape[1]}"
    return None


def _zigzag_gdp(q, k, v, g, beta, backend, group, rank, world, metadata, scale, num_householder, l2norm, error,
                signature):
    """The zig-zag layout's op (``torch_api.gdp.zigzag``): one backend call per local chunk."""
    from torch_api.gdp.zigzag import ZigzagCall, ZigzagGDP

    cu_seqlens, ranges = (None, None), ()
    if error is None:
        ranges = virtual_rank_ranges(metadata, rank, world, "zigzag")
        if metadata is not None:
            cu_seqlens = tuple(torch.tensor(shard.local_cu_seqlens, dtype=torch.int32).to(q.device)
                               for shard in metadata.shards)
    call = ZigzagCall(backend, group, ranges, torch.from_numpy(gathered_chunk_order(world, "zigzag")),
                      float(scale) if error is None else 0.0, num_householder, bool(l2norm), cu_seqlens, error,
                      tuple(signature))
    if error is not None and not all(isinstance(x, torch.Tensor) for x in (q, k, v, g, beta)):
        _agree(group, error, [], what="GDP context-parallel forward", cause=None)
    return ZigzagGDP.apply(call, q, k, v, g, beta)


def _local_initial_states(initial_state: torch.Tensor, routing, rank: int) -> torch.Tensor:
    """The initial states of this rank's local sequences [n, H, K, V]. A first sequence that began on an
    earlier rank keeps its row as the state the preceding summaries are folded from, with no gradient:
    that is counted on the rank where it starts (the backward summaries carry this rank's share there)."""
    rows = routing.local_rows[rank]
    local = initial_state.index_select(0, torch.tensor(rows, dtype=torch.int64).to(initial_state.device))
    if not routing.first_row_continues(rank):
        return local
    # torch.where rather than detach: initial_state still gets a gradient tensor (zero rows) on every rank
    continuing = torch.zeros(len(rows), 1, 1, 1, dtype=torch.bool)
    continuing[: len(rows) if routing.rows else 1] = True  # without ids every row continues from rank 0
    return torch.where(continuing.to(local.device), local.detach(), local)


def _replicated_final_states(local_final: torch.Tensor, routing, rank: int) -> torch.Tensor:
    """Local final states [n, H, K, V] -> [N, H, K, V]: the rows of sequences ending on this rank, zeros
    elsewhere (differentiable; rows continuing past this rank are partial states and dropped)."""
    ends = routing.ends_here(rank)
    positions = [i for i, end in enumerate(ends) if end]
    final = local_final.new_zeros((routing.num_sequences, *local_final.shape[1:]))
    # no shortcut when nothing ends here: the result stays attached to the op, so a loss on final_state
    # alone still runs this rank's backward (and its collectives) with zero cotangents
    rows = [routing.local_rows[rank][i] for i in positions]
    device = local_final.device
    return final.index_copy(0, torch.tensor(rows, dtype=torch.int64).to(device),
                            local_final.index_select(0, torch.tensor(positions, dtype=torch.int64).to(device)))


def context_parallel_gdp(q, k, v, g, beta, *, cp_group, global_seq_idx=None, metadata=None, scale=None,
                         num_householder=1, use_qk_l2norm_in_kernel=False, backend=None, check_inputs: bool = True,
                         agreed: bool = False, initial_state=None, output_final_state: bool = False,
                         summary_exchange: str = "all_gather", layout: str = "contiguous"):
    """``gdp_chunkwise_context_parallel`` for the layers: ``agreed=True`` (a model agreement covered the
    call's shapes, flags and ids, and ``check_inputs`` is False) sends no header in either direction."""
    from torch_api.gdp.ops import gate_or_zeros, resolve_backend

    group = resolve_group(cp_group)
    rank, world = group_rank_and_size(group)
    backend = resolve_backend(backend, q, k, v, num_householder)
    if scale is None and isinstance(q, torch.Tensor) and q.dim() == 4:
        scale = q.shape[-1] ** -0.5
    gate_given = g is not None
    g = gate_or_zeros(g, q)
    error = gdp_input_error(q, k, v, g, beta, num_householder=num_householder, scale=scale)
    exchange = resolve_summary_exchange(summary_exchange, world)
    if error is None and exchange is None:
        error = f"summary_exchange must be one of ('all_gather', 'scan', 'auto'); received {summary_exchange!r}"
    with_states = initial_state is not None or bool(output_final_state)
    zigzag = layout == "zigzag"
    if error is None:
        error = (f"layout must be one of {LAYOUTS}; received {layout!r}" if layout not in LAYOUTS else
                 zigzag_gdp_option_error(exchange, with_states, check_inputs) if zigzag else None)
    if error is None and global_seq_idx is not None:
        if metadata is not None:
            error = "pass global_seq_idx or metadata, not both"
        else:
            try:
                build = build_zigzag_cp_metadata if zigzag else build_packed_sequence_cp_metadata
                metadata = build(global_seq_idx, rank, world)
            except ValueError as err:
                error = str(err)
    if error is None and metadata is not None:
        error = _zigzag_metadata_error(metadata, rank, world, q) if zigzag else _metadata_error(metadata, rank, world, q)
    if error is None and zigzag and q.shape[1] % 2:
        error = f"layout='zigzag' holds two equal chunks per rank: the local length must be even; received {q.shape[1]}"
    routing = None
    if error is None and (with_states or exchange == "scan"):
        if metadata is not None:
            routing = sequence_state_routing(metadata.global_seq_idx.reshape(1, -1), world)
        else:
            routing = sequence_state_routing(None, world, rows=q.shape[0])
    if error is None and initial_state is not None:
        error = initial_state_error(initial_state, routing.num_sequences, q, v,
                                    rows=" (one row per global sequence, the same on every rank)")
    if error is None and with_states and not check_inputs:
        error = ("initial_state / output_final_state need check_inputs=True: containment of non-finite inputs "
                 "(check_inputs=False) does not cover the sequence states")
    if error is None and with_states and not getattr(backend, "supports_sequence_states", False):
        error = (f"backend {type(backend).__name__} does not declare supports_sequence_states: initial_state / "
                 "output_final_state need per-sequence states (cp_linear.gdp.GDPInputs)")
    cu_seqlens = None
    if metadata is not None and error is None and not zigzag:
        cu_seqlens = torch.tensor(metadata.local_cu_seqlens, dtype=torch.int32).to(q.device, non_blocking=True)
        preceding, following = slice(metadata.preceding_rank_start, rank), slice(rank + 1, metadata.following_rank_stop)
    else:
        preceding, following = slice(0, rank), slice(rank + 1, world)
    signature = []
    if error is None:
        fingerprint = metadata.fingerprint if metadata is not None else 0
        signature = [*q.shape, v.shape[-1], num_householder, dtype_code(q.dtype), dtype_code(g.dtype),
                     dtype_code(beta.dtype), int(bool(use_qk_l2norm_in_kernel)), float_bits(scale),
                     int(metadata is not None), world, int(bool(check_inputs)), fingerprint,
                     int(initial_state is not None), int(bool(output_final_state)), int(exchange == "scan"),
                     LAYOUTS.index(layout)]
    if zigzag:
        return _zigzag_gdp(q, k, v, g if gate_given else g.detach(), beta, backend, group, rank, world, metadata,
                           scale, num_householder, use_qk_l2norm_in_kernel, error, signature)
    schedules = (None, None)
    if error is None and exchange == "scan":
        schedules = (scan_schedule(routing, descending=False), scan_schedule(routing, descending=True))
    call = _CPCall(backend, group, preceding, following, float(scale) if error is None else 0.0, num_householder,
                   bool(use_qk_l2norm_in_kernel), cu_seqlens, bool(check_inputs), error, tuple(signature),
                   bool(agreed) and not check_inputs, bool(output_final_state), *schedules)
    tensors = (q, k, v, g, beta) + (() if initial_state is None else (initial_state,))
    if error is not None and not all(isinstance(x, torch.Tensor) for x in tensors):
        # autograd.Function needs tensors; agree (and raise) here instead
        _agree(group, error, [], what="GDP context-parallel forward", cause=None)
    local_initial = None
    if initial_state is not None and error is None:
        local_initial = _local_initial_states(initial_state, routing, rank)
    contain = error is None and not check_inputs
    trailing = token_flags = None
    if contain:
        # raw inputs and their token flags for a backend that zeroes flagged rows, else sanitised copies; the
        # select below stays either way (poison from earlier ranks is known only after the exchange)
        state_bad, read_bad, (q, k, v, g, beta), token_flags = contained_inputs(q, k, v, g, beta, num_householder,
                                                                                backend=backend)
        start = sequence_start_index(q.shape[1], cu_seqlens, q.device)
        trailing = trailing_bad(state_bad, start)
    g = g if gate_given else g.detach()
    output, local_final, incoming_bad = _ContextParallelGDP.apply(call, trailing, token_flags, q, k, v, g, beta,
                                                                  local_initial)
    if contain:
        mask = token_poison(state_bad, read_bad, start, incoming_bad)
        output = poison(output, mask[..., None])
    if not output_final_state:
        return output
    return output, _replicated_final_states(local_final, routing, rank)
