"""``torch.library`` custom ops for the GDP ops: fake (meta) kernels and registered autograd, so that
``torch.compile(fullgraph=True)`` traces a model through them without graph breaks.

Ops (namespace ``cp_linear``; every output a fresh contiguous tensor):

  gdp_forward      one device    (q, k, v, g, beta, cu_seqlens?, initial_state?, state_bad?, read_bad?)
                                 -> (o [B, T, H, V], final_state f32 [N, H, K, V],
                                     incoming f32, transition f32, segment_states f32)
  gdp_backward                   (do, d_final_state, inputs, incoming, transition, segment_states)
                                 -> (dq, dk, dv, dg, dbeta, d_initial_state f32 ([0] without one))
  gdp_cp_forward   one CP rank   (q, k, v, g, beta, cu_seqlens?, rank_range, trailing_bad, state_bad?,
                                  read_bad?) -> (o, incoming, transition, segment_states, incoming_bad)
  gdp_cp_backward                (do, inputs, rank_range, incoming, transition, segment_states)
                                 -> (dq, dk, dv, dg, dbeta)

``state_bad`` / ``read_bad`` (uint8 [B, T, H], both or neither): the containment's token flags for a
backend that zeroes flagged rows itself (``cp_linear.gdp.GDPInputs.token_flags``); the inputs are then
raw. The backward ops take them too ("inputs" above), and the saved context rebuilt there keeps them
(``torch_api.gdp.cutedsl.with_token_flags``).

``incoming`` ([H, K, V] packed, [B, H, K, V] rows) and ``transition`` ([H, K, K] / [B, H, K, K]) are
the two tensors of the backend's saved context that are not inputs (``torch_api.gdp.chunk.
make_cp_saved_context``); ``segment_states`` is the extra one that
``CuTeDSLGatedDeltaProductCPBackend(backward="kernels")`` (the default) saves for its backward
kernels: one float32 buffer holding the segments' incoming states (its first region, hence the
name), the chunk prep results and the work layout's tables (size from the shapes:
``saved_buffer_shape``), or an empty [0] for a backend that saves none. The forward
returns them so that autograd saves them, and the backward rebuilds the context from them and the
inputs. ``TorchGDPBackend`` and ``CuTeDSLGatedDeltaProductCPBackend`` (either backward) go through
these ops under ``torch.compile``; any other backend (``has_op_layout``), and every backend in eager
mode for the one-device op (less host time per step, the same numbers: ``torch_api.gdp.ops._run``),
takes the eager ``autograd.Function`` path.

The CP ops run their all-gather inside (the fake kernels need none). ``rank_range`` int [2] =
(preceding_rank_start, following_rank_stop) lives on the device: summaries of ranks outside the
range are replaced by the identity (``[0 | I]``) instead of being sliced away, so a new packing of
the same shapes changes tensor values only — no recompilation, no host read, replayable in a CUDA
graph. Backends are named by strings (``backend_name``), the process group by its ``group_name``.
Cross-rank agreement happens before an op is called (``torch_api.gdp.cp``, ``ShardLayout.agree``),
never inside one.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from cp_linear.protocol import CPSavedContext
from torch_api._dist import all_gather_single
from torch_api.gdp.types import GDPInputs, float32_region

_BACKENDS: dict[str, object] = {}


# --------------------------------------------------------------------------- backends and groups by name


def has_op_layout(backend) -> bool:
    """True when the custom ops can rebuild ``backend``'s saved context in the backward:
    ``make_cp_saved_context``'s (inputs + incoming + transition), plus the kernel backward's segment
    states for the CuTeDSL backend. Any other backend's context is opaque to the ops."""
    from torch_api.gdp.chunk import TorchGDPBackend
    from torch_api.gdp.cutedsl import CuTeDSLGatedDeltaProductCPBackend

    return type(backend) is TorchGDPBackend or isinstance(backend, CuTeDSLGatedDeltaProductCPBackend)


_NAME_ATTRIBUTE = "_cp_linear_op_name"


def backend_name(backend) -> str:
    """A string naming ``backend`` for the ops (the instance stays registered for the process).

    The name is stored on the instance at its first registration, so a later call (inside a
    ``torch.compile`` trace too) only reads an attribute: no ``id()`` formatted under dynamo, which
    cannot turn it into a constant, and the same name for every packing, so no recompilation. The
    layers register their backends eagerly (``register_backend``)."""
    name = getattr(backend, _NAME_ATTRIBUTE, None)
    if name is None or _BACKENDS.get(name) is not backend:
        name = f"{type(backend).__name__}#{len(_BACKENDS)}"
        _BACKENDS[name] = backend
        setattr(backend, _NAME_ATTRIBUTE, name)
    return name


def register_backend(backend) -> None:
    """Name ``backend`` now, outside any trace (``backend_name``); a no-op for names and None."""
    if backend is not None and not isinstance(backend, str):
        backend_name(backend)


def _backend(name: str):
    return _BACKENDS[name]


def _group(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _inputs(q, k, v, g, beta, cu_seqlens, scale, num_householder, l2norm, initial_state=None, final=False,
            save_for_backward=True, state_bad=None, read_bad=None):
    token_flags = None if state_bad is None else (state_bad, read_bad)
    return GDPInputs(q, k, v, g, beta, scale, num_householder, l2norm, cu_seqlens, initial_state, final,
                     save_for_backward, token_flags)


def _state_shapes(q, v, packed: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the saved incoming state and transition: [H, K, V], [H, K, K] (packed) or with B."""
    batch, _, heads, key_dim = q.shape
    lead = (heads, key_dim) if packed else (batch, heads, key_dim)
    return (*lead, v.shape[-1]), (*lead, key_dim)


def _fresh(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` as an op output: contiguous, at storage offset 0 (what the fake kernels promise)."""
    x = x if dtype is None or x.dtype == dtype else x.to(dtype)  # no Tensor.to op when there is nothing to do
    if x.is_contiguous() and x.storage_offset() == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _unaliased(outputs, inputs) -> tuple[torch.Tensor, ...]:
    """``outputs`` with any tensor that shares storage with an input or an earlier output cloned:
    a custom op's outputs may alias neither."""
    seen = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor) and x.numel()}
    result = []
    for out in outputs:
        pointer = out.untyped_storage().data_ptr()
        if out.numel() and pointer in seen:
            out = out.clone(memory_format=torch.contiguous_format)
            pointer = out.untyped_storage().data_ptr()
        seen.add(pointer)
        result.append(out)
    return tuple(result)


def _saved_extras(saved: CPSavedContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(incoming, transition, segment_states) of a saved context; segment_states empty [0] when none."""
    from torch_api.gdp.cutedsl import kernel_saved_of

    incoming, transition = saved.tensors[6], saved.tensors[7]
    states = kernel_saved_of(saved)
    states = incoming.new_empty(0, dtype=torch.float32) if states is None else _fresh(states, torch.float32)
    return _fresh(incoming, torch.float32), _fresh(transition, torch.float32), states


def _fake_segment_states(impl, inputs) -> torch.Tensor:
    """The fake ``segment_states`` output: the backend's saved-state shape, or [0]."""
    shape_of = getattr(impl, "saved_buffer_shape", None)
    shape = None if shape_of is None else shape_of(inputs)
    return inputs.q.new_empty((0,) if shape is None else shape, dtype=torch.float32)


def _saved_context(inputs, incoming, transition, segment_states) -> CPSavedContext:
    """The backend's saved context, rebuilt in a backward op from the inputs (with their token flags, if any)
    and the saved outputs."""
    from torch_api.gdp.chunk import make_cp_saved_context
    from torch_api.gdp.cutedsl import with_kernel_saved, with_token_flags

    saved = make_cp_saved_context(inputs, incoming, transition)
    saved = with_kernel_saved(saved, segment_states if segment_states.numel() else None)
    return with_token_flags(saved, inputs.token_flags)


def _grads(grads, q, k, v, g, beta) -> tuple[torch.Tensor, ...]:
    return tuple(_fresh(grad, x.dtype) for grad, x in
                 zip((grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta), (q, k, v, g, beta)))


@contextlib.contextmanager
def _autograd_inside():
    """Autograd back on inside an op's real kernel: the dispatcher runs the kernel below the autograd
    keys, but the reference backward takes each chunk's gradients with ``torch.autograd.grad`` over a
    recomputation (``torch_api.gdp.chunk``)."""
    with torch._C._PreserveDispatchKeyGuard():  # restores the exclude set on exit
        for key in _AUTOGRAD_KEYS:
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
        with torch.enable_grad():
            yield


@contextlib.contextmanager
def _functorch_inside():
    """functorch's transforms (vmap) back on inside an op's real kernel: an op called from a Python
    dispatch mode (AOTAutograd's aliasing check on a compiled graph's first call) runs with them excluded."""
    with torch._C._PreserveDispatchKeyGuard():
        for key in _FUNCTORCH_KEYS:
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
        yield


_FUNCTORCH_KEYS = tuple(getattr(torch._C.DispatchKey, name) for name in (
    "FuncTorchDynamicLayerFrontMode", "FuncTorchDynamicLayerBackMode", "FuncTorchBatched", "FuncTorchVmapMode",
    "BatchedNestedTensor", "FuncTorchGradWrapper") if hasattr(torch._C.DispatchKey, name))


_AUTOGRAD_KEYS = tuple(getattr(torch._C.DispatchKey, name) for name in (
    "ADInplaceOrView", "AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "AutogradCPU",
    "AutogradCUDA") if hasattr(torch._C.DispatchKey, name))


# --------------------------------------------------------------------------- one device


@torch.library.custom_op("cp_linear::gdp_forward", mutates_args=())
def gdp_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                cu_seqlens: torch.Tensor | None, initial_state: torch.Tensor | None, scale: float,
                num_householder: int, use_qk_l2norm_in_kernel: bool, backend: str, save_for_backward: bool = True,
                state_bad: torch.Tensor | None = None, read_bad: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """save_for_backward False (no gradient will be asked for): segment_states may come back empty.
    state_bad, read_bad: token flags (module docstring)."""
    impl = _backend(backend)
    inputs = _inputs(q, k, v, g, beta, cu_seqlens, scale, num_householder, use_qk_l2norm_in_kernel,
                     initial_state, True, save_for_backward, state_bad, read_bad)
    with float32_region(q.device):
        summary, local = impl.cp_forward_prepare(inputs)
        (output, final_state), saved = impl.cp_forward_apply(local, _empty_stack(summary))
    return _unaliased((_fresh(output), _fresh(final_state, torch.float32), *_saved_extras(saved)),
                      (q, k, v, g, beta, cu_seqlens, initial_state, state_bad, read_bad))


@gdp_forward.register_fake
def _(q, k, v, g, beta, cu_seqlens, initial_state, scale, num_householder, use_qk_l2norm_in_kernel, backend,
      save_for_backward=True, state_bad=None, read_bad=None):
    batch, tokens, heads, key_dim = q.shape
    sequences = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    incoming, transition = _state_shapes(q, v, cu_seqlens is not None)
    f32 = dict(dtype=torch.float32, device=q.device)
    inputs = _inputs(q, k, v, g, beta, cu_seqlens, scale, num_householder, use_qk_l2norm_in_kernel,
                     initial_state, True, save_for_backward)
    return (q.new_empty((batch, tokens, heads, v.shape[-1])), q.new_empty((sequences, heads, key_dim, v.shape[-1]),
                                                                          **f32),
            q.new_empty(incoming, **f32), q.new_empty(transition, **f32),
            _fake_segment_states(_backend(backend), inputs))


@torch.library.custom_op("cp_linear::gdp_backward", mutates_args=())
def gdp_backward(do: torch.Tensor | None, d_final_state: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor | None,
                 initial_state: torch.Tensor | None, incoming: torch.Tensor, transition: torch.Tensor,
                 segment_states: torch.Tensor, scale: float, num_householder: int, use_qk_l2norm_in_kernel: bool,
                 backend: str, state_bad: torch.Tensor | None = None, read_bad: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = _backend(backend)
    inputs = _inputs(q, k, v, g, beta, cu_seqlens, scale, num_householder, use_qk_l2norm_in_kernel,
                     initial_state, True, state_bad=state_bad, read_bad=read_bad)
    saved = _saved_context(inputs, incoming, transition, segment_states)
    from torch_api.gdp.ops import one_device_backward

    with float32_region(q.device), _autograd_inside():
        grads, d_initial = one_device_backward(impl, do, d_final_state, saved)
    d_initial = q.new_empty(0, dtype=torch.float32) if initial_state is None else d_initial.float()
    return _unaliased((*_grads(grads, q, k, v, g, beta), _fresh(d_initial)),
                      (do, d_final_state, q, k, v, g, beta, cu_seqlens, initial_state, incoming, transition,
                       segment_states, state_bad, read_bad))


@gdp_backward.register_fake
def _(do, d_final_state, q, k, v, g, beta, cu_seqlens, initial_state, incoming, transition, segment_states, scale,
      num_householder, use_qk_l2norm_in_kernel, backend, state_bad=None, read_bad=None):
    d_initial = (q.new_empty(0, dtype=torch.float32) if initial_state is None
                 else initial_state.new_empty(initial_state.shape, dtype=torch.float32))
    return (*(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta)), d_initial)


def _setup_gdp(ctx, inputs, output):
    q, k, v, g, beta, cu_seqlens, initial_state, scale, num_householder, l2norm, backend, _, *flags = inputs
    _, _, incoming, transition, segment_states = output
    # the token flags (state_bad, read_bad; None without): the backward's saved context keeps them
    ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, initial_state, incoming, transition, segment_states, *flags)
    ctx.options = (scale, num_householder, l2norm, backend)
    ctx.initial_dtype = None if initial_state is None else initial_state.dtype
    ctx.set_materialize_grads(False)


def _gdp_autograd(ctx, do, d_final_state, _d_incoming, _d_transition, _d_segment_states):
    if do is None and d_final_state is None:
        return (None,) * 14
    q, k, v, g, beta, cu_seqlens, initial_state, incoming, transition, segment_states, *flags = ctx.saved_tensors
    dq, dk, dv, dg, dbeta, d_initial = gdp_backward(do, d_final_state, q, k, v, g, beta, cu_seqlens, initial_state,
                                                    incoming, transition, segment_states, *ctx.options, *flags)
    d_initial = None if ctx.initial_dtype is None else d_initial.to(ctx.initial_dtype)
    return dq, dk, dv, dg, dbeta, None, d_initial, None, None, None, None, None, None, None


gdp_forward.register_autograd(_gdp_autograd, setup_context=_setup_gdp)


# --------------------------------------------------------------------------- one CP rank


def _gather(summary: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # detached: inside a backward op a summary built from saved outputs (the kernel backward's
    # transition) requires grad, and gloo's all-gather then refuses its in-place copy; the ops
    # register their own backward, so autograd never runs through the gather
    summary = summary.detach()
    world = dist.get_world_size(group)
    flat = summary.new_empty(world * summary.numel())
    all_gather_single(flat, summary.contiguous().view(-1), group=group)
    return flat.view(world, *summary.shape)


def _identity_like(stack: torch.Tensor) -> torch.Tensor:
    """``[0 | I]`` shaped like ``stack`` [n, ..., K, V + K]: the summary that changes nothing."""
    key_dim = stack.shape[-2]
    identity = torch.zeros_like(stack)
    identity[..., stack.shape[-1] - key_dim:] = torch.eye(key_dim, dtype=stack.dtype, device=stack.device)
    return identity


def _masked_stack(gathered: torch.Tensor, first: int, stop: int, keep_from, keep_to) -> torch.Tensor:
    """``gathered[first:stop]`` with the entries of ranks outside [keep_from, keep_to) (device
    scalars) replaced by the identity: static shapes, no host read."""
    stack = gathered[first:stop]
    ranks = torch.arange(first, stop, device=stack.device)
    keep = (ranks >= keep_from) & (ranks < keep_to)
    keep = keep.view(-1, *([1] * (stack.dim() - 1)))
    return torch.where(keep, stack, _identity_like(stack))


def _packed(summary) -> torch.Tensor:
    from cp_linear.summary import as_packed_array

    return as_packed_array(summary)


def _empty_stack(summary) -> torch.Tensor:
    packed = _packed(summary)
    return packed.new_empty((0, *packed.shape))


@torch.library.custom_op("cp_linear::gdp_cp_forward", mutates_args=())
def gdp_cp_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   cu_seqlens: torch.Tensor | None, rank_range: torch.Tensor, trailing_bad: torch.Tensor, scale: float,
                   num_householder: int, use_qk_l2norm_in_kernel: bool, backend: str, group_name: str,
                   save_for_backward: bool = True, state_bad: torch.Tensor | None = None,
                   read_bad: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """trailing_bad: bool [B or 1, H] for containment (``torch_api.gdp.isolation``: those heads'
    summaries travel as NaN; the last output, incoming_bad [B or 1, H], says which heads of the
    incoming state were poisoned), or an empty [0] without (incoming_bad is then [0] too).
    save_for_backward False (no gradient will be asked for): segment_states may come back empty.
    state_bad, read_bad: token flags (module docstring)."""
    inputs = _inputs(q, k, v, g, beta, cu_seqlens, scale, num_householder, use_qk_l2norm_in_kernel,
                     save_for_backward=save_for_backward, state_bad=state_bad, read_bad=read_bad)
    output, saved, incoming_bad = cp_forward(_backend(backend), _group(group_name), inputs, rank_range, trailing_bad)
    return _unaliased((_fresh(output), *_saved_extras(saved), _fresh(incoming_bad)),
                      (q, k, v, g, beta, cu_seqlens, rank_range, trailing_bad, state_bad, read_bad))


def cp_forward(impl, group: dist.ProcessGroup, inputs: GDPInputs, rank_range: torch.Tensor,
               trailing_bad: torch.Tensor) -> tuple[torch.Tensor, CPSavedContext, torch.Tensor]:
    """The body of ``gdp_cp_forward`` (also the eager path, ``torch_api.gdp.cp.run_cp_op``): prepare,
    the all-gather of the summaries (ranks outside ``rank_range`` as the identity), apply ->
    (o, the backend's saved context, incoming_bad)."""
    from torch_api.gdp.isolation import incoming_bad_and_clean, poison_summary

    rank = dist.get_rank(group)
    range_ = rank_range.to(inputs.q.device)
    contain = trailing_bad.numel() > 0
    with float32_region(inputs.q.device):
        summary, local = impl.cp_forward_prepare(inputs)
        if contain:
            summary = poison_summary(summary, trailing_bad)
        gathered = _gather(_packed(summary), group)
        preceding = _masked_stack(gathered, 0, rank, range_[0], rank)
        incoming_bad = trailing_bad.new_zeros(0)
        if contain:
            incoming_bad, preceding = incoming_bad_and_clean(preceding)
        output, saved = impl.cp_forward_apply(local, preceding)
    return output, saved, incoming_bad


@gdp_cp_forward.register_fake
def _(q, k, v, g, beta, cu_seqlens, rank_range, trailing_bad, scale, num_householder, use_qk_l2norm_in_kernel,
      backend, group_name, save_for_backward=True, state_bad=None, read_bad=None):
    incoming, transition = _state_shapes(q, v, cu_seqlens is not None)
    f32 = dict(dtype=torch.float32, device=q.device)
    inputs = _inputs(q, k, v, g, beta, cu_seqlens, scale, num_householder, use_qk_l2norm_in_kernel,
                     save_for_backward=save_for_backward)
    bad_shape = (0,) if trailing_bad.numel() == 0 else (1 if cu_seqlens is not None else q.shape[0], q.shape[2])
    return (q.new_empty((*q.shape[:3], v.shape[-1])), q.new_empty(incoming, **f32), q.new_empty(transition, **f32),
            _fake_segment_states(_backend(backend), inputs), trailing_bad.new_empty(bad_shape))


@torch.library.custom_op("cp_linear::gdp_cp_backward", mutates_args=())
def gdp_cp_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, cu_seqlens: torch.Tensor | None, rank_range: torch.Tensor,
                    incoming: torch.Tensor, transition: torch.Tensor, segment_states: torch.Tensor, scale: float,
                    num_householder: int, use_qk_l2norm_in_kernel: bool, backend: str, group_name: str,
                    state_bad: torch.Tensor | None = None, read_bad: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    inputs = _inputs(q, k, v, g, beta, cu_seqlens, scale, num_householder, use_qk_l2norm_in_kernel,
                     state_bad=state_bad, read_bad=read_bad)
    saved = _saved_context(inputs, incoming, transition, segment_states)
    with _autograd_inside():
        grads = cp_backward(_backend(backend), _group(group_name), do, saved, rank_range)
    return _unaliased(_grads(grads, q, k, v, g, beta),
                      (do, q, k, v, g, beta, cu_seqlens, rank_range, incoming, transition, segment_states, state_bad,
                       read_bad))


def cp_backward(impl, group: dist.ProcessGroup, do: torch.Tensor, saved: CPSavedContext, rank_range: torch.Tensor):
    """The body of ``gdp_cp_backward`` (also the eager path): prepare, the all-gather of the backward
    summaries (ranks outside ``rank_range`` as the identity), apply -> the backend's input gradients."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    range_ = rank_range.to(do.device)
    with float32_region(do.device):
        summary, context = impl.cp_backward_prepare(do, saved)
        gathered = _gather(_packed(summary), group)
        following = _masked_stack(gathered, rank + 1, world, rank + 1, range_[1])
        return impl.cp_backward_apply(context, following)


@gdp_cp_backward.register_fake
def _(do, q, k, v, g, beta, cu_seqlens, rank_range, incoming, transition, segment_states, scale, num_householder,
      use_qk_l2norm_in_kernel, backend, group_name, state_bad=None, read_bad=None):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta))


def _setup_cp(ctx, inputs, output):
    q, k, v, g, beta, cu_seqlens, rank_range, _, scale, num_householder, l2norm, backend, group_name, _, *flags = (
        inputs)
    _, incoming, transition, segment_states, _ = output
    ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, rank_range, incoming, transition, segment_states, *flags)
    ctx.options = (scale, num_householder, l2norm, backend, group_name)


def output_grad_or_zeros(do: torch.Tensor | None, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The CP backward's contiguous output gradient; zeros without one: every rank runs the backward's
    collectives, with or without a gradient (the custom op's autograd and the eager path)."""
    if do is None:
        return torch.zeros((*q.shape[:3], v.shape[-1]), dtype=q.dtype, device=q.device)
    return do.contiguous()


def _cp_autograd(ctx, do, _d_incoming, _d_transition, _d_segment_states, _d_incoming_bad):
    q, k, v, g, beta, cu_seqlens, rank_range, incoming, transition, segment_states, *flags = ctx.saved_tensors
    grads = gdp_cp_backward(output_grad_or_zeros(do, q, v), q, k, v, g, beta, cu_seqlens, rank_range, incoming,
                            transition, segment_states, *ctx.options, *flags)
    return (*grads, *(None,) * 11)


gdp_cp_forward.register_autograd(_cp_autograd, setup_context=_setup_cp)


__all__ = ["backend_name", "cp_backward", "cp_forward", "gdp_backward", "gdp_cp_backward", "gdp_cp_forward", "gdp_forward",
           "has_op_layout", "output_grad_or_zeros", "register_backend"]
