"""One-device Gated DeltaProduct with autograd: ``gated_delta_product`` (no context parallelism).

Returns ``(o, final_state)`` like ``cp_linear.reference.naive_gated_delta_product`` and like
flash-linear-attention's ``chunk_gated_delta_product(..., output_final_state=True)``:
o [B, T, H, V] in q's dtype, final_state float32 [N, H, K, V] (N = B, or the number of sequences
in ``cu_seqlens``). Gradients flow to q, k, v, g, beta and ``initial_state``.

The op runs through the backend's four functions (``cp_linear.protocol``) with empty neighbour
stacks: the inputs carry the per-sequence initial states and ask for the final states
(``cp_linear.gdp.GDPInputs``), so ``cp_forward_apply`` returns ``(o, final_state)`` and
``cp_backward_prepare`` takes ``(do, d_final_state)``; the backend declares these sequence states
with ``supports_sequence_states`` (``TorchGDPBackend`` and the CuTeDSL backend do).
"""

from __future__ import annotations

import torch

from cp_linear.chunking import bounds_after_first
from cp_linear.gdp import GDPInputs, cu_seqlens_error
from cp_linear.protocol import CPSavedContext
from cp_linear.summary import as_packed_array
from cp_linear.validation import GDP_VALUE_CHECKS, NONFINITE, nonfinite_rows
from torch_api._poison import poison
from torch_api.gdp.isolation import contained_inputs, sanitized, sequence_bad, sequence_start_index, token_poison
from torch_api.gdp.types import float32_region, needs_backward
from torch_api.gdp.validation import (
    PendingValueChecks,
    gdp_input_error,
    gdp_value_flags,
    initial_state_error,
    nonfinite_flags,
)


def _empty_stack(summary) -> torch.Tensor:
    """[0, ...] neighbour summaries shaped like ``summary`` (no rank before or after)."""
    packed = as_packed_array(summary)
    return packed.new_empty((0, *packed.shape))


def one_device_backward(backend, output_grad, final_state_grad, saved: CPSavedContext):
    """-> (input gradients, dL/d initial state or None) with no neighbour: the backend's
    ``one_device_backward`` where it has one (it skips the backward summary no rank receives), else
    ``cp_backward_prepare`` and ``cp_backward_apply`` with an empty stack."""
    if hasattr(backend, "one_device_backward"):
        return backend.one_device_backward(output_grad, final_state_grad, saved)
    summary, context = backend.cp_backward_prepare((output_grad, final_state_grad), saved)
    grads = backend.cp_backward_apply(context, _empty_stack(summary))
    return grads._replace(dinitial_state=None), grads.dinitial_state


def gate_or_zeros(g, q: torch.Tensor) -> torch.Tensor:
    """``g`` as given, or zeros [B, T, H] float32 for no gate (``g=None``, as in flash-linear-attention)."""
    if g is None and isinstance(q, torch.Tensor) and q.dim() == 4:
        return torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
    return g


class _GatedDeltaProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend, options, q, k, v, g, beta, initial_state):
        """options: ``GDPInputs``'s other fields, ``token_flags`` among them for a backend that zeroes flagged
        rows (integer tensors: no gradient; the backend's saved context keeps them for the backward)."""
        inputs = GDPInputs(q, k, v, g, beta, **options, initial_state=initial_state, output_final_state=True)
        if not inputs.save_for_backward and hasattr(backend, "one_device_forward"):
            # no backward follows: the backend's one-device plan (the kernels' leaner inference plan)
            with float32_region(q.device):
                output, final_state, _ = backend.one_device_forward(inputs, initial_state)
            return output, final_state
        with float32_region(q.device):
            summary, local = backend.cp_forward_prepare(inputs)
            (output, final_state), saved = backend.cp_forward_apply(local, _empty_stack(summary))
        ctx.backend = backend
        ctx.saved_metadata = saved.metadata
        ctx.initial_dtype = None if initial_state is None else initial_state.dtype
        ctx.save_for_backward(*saved.tensors)
        ctx.set_materialize_grads(False)
        return output, final_state

    @staticmethod
    def backward(ctx, output_grad, final_state_grad):
        if output_grad is None and final_state_grad is None:
            return (None,) * 8
        saved = CPSavedContext(tuple(ctx.saved_tensors), ctx.saved_metadata)
        device = (output_grad if output_grad is not None else final_state_grad).device
        with float32_region(device):
            grads, d_initial = one_device_backward(ctx.backend, output_grad, final_state_grad, saved)
        initial_grad = None if ctx.initial_dtype is None else d_initial.to(ctx.initial_dtype)
        return None, None, grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, initial_grad


def gated_delta_product(q, k, v, g, beta, *, scale=None, num_householder=1, cu_seqlens=None,
                        initial_state=None, use_qk_l2norm_in_kernel=False, backend=None, check_inputs=True):
    """Gated DeltaProduct on one device (docs/design.md §2), differentiable.

    q [B, T, H, K], k [B, T*n_h, H, K], v [B, T*n_h, H, V], g [B, T, H] (log decay; None = no
    gate), beta [B, T*n_h, H]; fp32 / bf16 / fp16. cu_seqlens int [N + 1] for a packed batch
    (B = 1), nondecreasing (an empty sequence keeps its initial state), read once on the host for
    validation; initial_state [N, H, K, V] (zeros when None).
    Returns (o [B, T, H, V], final_state float32 [N, H, K, V]). K ≤ 256, V ≤ 512.

    check_inputs: reject NaN/Inf (inputs and initial_state), g > 0 and beta outside [0, 2] with a
    ValueError (one host read per call). With False nothing is read and non-finite inputs are
    contained: the outputs and final states that depend on them are NaN, the rest exact
    (``torch_api.gdp.isolation``, docs/failure_modes.md).
    """
    backend = resolve_backend(backend, q, k, v, num_householder)
    for method in ("cp_forward_prepare", "cp_forward_apply", "cp_backward_prepare", "cp_backward_apply"):
        if not callable(getattr(backend, method, None)):
            raise ValueError(f"backend {type(backend).__name__} has no {method}(); gated_delta_product runs the "
                             "four-function protocol (cp_linear.protocol)")
    if not getattr(backend, "supports_sequence_states", False):
        raise ValueError(f"backend {type(backend).__name__} does not declare supports_sequence_states: the one-device "
                         "op needs per-sequence initial and final states (cp_linear.gdp.GDPInputs)")
    gate_given = g is not None
    g = gate_or_zeros(g, q)
    scale = q.shape[-1] ** -0.5 if scale is None and isinstance(q, torch.Tensor) else scale
    error = gdp_input_error(q, k, v, g, beta, num_householder=num_householder, scale=scale, cu_seqlens=cu_seqlens)
    if error is None and cu_seqlens is not None:
        error = cu_seqlens_error(cu_seqlens.tolist(), q.shape[1])
    if error is None and initial_state is not None:
        sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        error = initial_state_error(initial_state, sequences, q, v)
    if error:
        raise ValueError(error)
    pending = None
    if check_inputs:  # read after the forward is queued (PendingValueChecks: the host waits for the checks only)
        flags = gdp_value_flags(q, k, v, g, beta)
        checks = GDP_VALUE_CHECKS
        if initial_state is not None:
            flags = torch.cat([flags, nonfinite_flags(initial_state)])
            checks = checks + (("initial_state", NONFINITE + " in initial_state"),)
        pending = PendingValueChecks(checks, flags, "gated_delta_product")
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(q.device)
    result = run_gated_delta_product(q, k, v, g if gate_given else g.detach(), beta, backend=backend,
                                     scale=float(scale), num_householder=num_householder, cu_seqlens=cu_seqlens,
                                     initial_state=initial_state,
                                     use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel), contain=not check_inputs)
    if pending is not None:
        pending.raise_if_failed()
    return result


def run_gated_delta_product(q, k, v, g, beta, *, backend, scale: float, num_householder: int, cu_seqlens=None,
                            initial_state=None, use_qk_l2norm_in_kernel: bool = False, contain: bool = False):
    """The op after validation (the layers call it with inputs they built): the ``cp_linear::gdp_forward``
    custom op for backends whose saved context it carries (traceable by ``torch.compile``), the eager
    ``autograd.Function`` for any other backend. g must be a tensor. contain: non-finite inputs are
    contained as with ``check_inputs=False`` (``torch_api.gdp.isolation``): sanitised inputs and a select of
    NaN over the poisoned outputs, or, for a backend that zeroes flagged rows (``zeroes_flagged_rows``) where
    the token-checks kernel runs, the raw inputs with token flags that mark every poisoned token read_bad:
    the backend then stores those outputs as NaN and takes their gradient as zero itself (no select over o
    and dO here; ``GDPInputs.token_flags``). -> (o, final_state)."""
    if not contain:
        return _run(backend, q, k, v, g, beta, initial_state, scale=scale, num_householder=num_householder,
                    cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    state_bad, read_bad, clean, token_flags = contained_inputs(q, k, v, g, beta, num_householder, backend=backend)
    start = None if cu_seqlens is None else sequence_start_index(q.shape[1], cu_seqlens, q.device)  # None: rows
    mask = token_poison(state_bad, read_bad, start)
    final_bad = sequence_bad(state_bad, cu_seqlens)
    if initial_state is not None:
        initial_bad = nonfinite_rows(initial_state, 2)  # [N, H]
        final_bad = final_bad | initial_bad
        if cu_seqlens is None:
            mask = mask | initial_bad[:, None, :]
        else:
            sequence = bounds_after_first(cu_seqlens.to(torch.int64), torch.arange(q.shape[1], device=q.device))
            mask = mask | initial_bad[sequence][None]
        (initial_state,) = sanitized(initial_state)
    if token_flags is not None:  # every poisoned token read_bad: the backend stores NaN there (no select below)
        token_flags = (token_flags[0], _as_uint8(mask))
    output, final_state = _run(backend, *clean, initial_state, scale=scale,
                               num_householder=num_householder, cu_seqlens=cu_seqlens,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, token_flags=token_flags)
    if token_flags is None:
        output = poison(output, mask[..., None])
    # [N, H, 1, 1] by one view (indexing with two Nones dispatches two unsqueezes)
    return output, poison(final_state, final_bad.view(*final_bad.shape, 1, 1))


def _as_uint8(mask: torch.Tensor) -> torch.Tensor:
    """bool -> uint8 (the token flags' type): a view in eager mode (no copy), a cast under ``torch.compile``."""
    return mask.to(torch.uint8) if torch.compiler.is_compiling() else mask.view(torch.uint8)


def _run(backend, q, k, v, g, beta, initial_state, *, scale, num_householder, cu_seqlens, use_qk_l2norm_in_kernel,
         token_flags=None):
    """The ``cp_linear::gdp_forward`` custom op while ``torch.compile`` traces (and for a backend whose
    saved context it carries); in eager mode the ``autograd.Function``, which gives the same numbers
    (tests/torch_api/test_custom_ops.py) for ~0.2 ms less host time per step: the custom op's Python
    dispatch layers (autograd wrapper, redispatch, the dynamo-disabled implementation, output
    unaliasing) run twice a step. token_flags: ``GDPInputs.token_flags`` (None without)."""
    from torch_api.gdp.library import backend_name, has_op_layout

    save_for_backward = needs_backward(q, k, v, g, beta, initial_state)
    if has_op_layout(backend) and torch.compiler.is_compiling():
        output, final_state, *_ = torch.ops.cp_linear.gdp_forward(
            q, k, v, g, beta, cu_seqlens, initial_state, scale, num_householder, use_qk_l2norm_in_kernel,
            backend_name(backend), save_for_backward, *(token_flags or (None, None)))
        return output, final_state
    options = dict(scale=scale, num_householder=num_householder, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   cu_seqlens=cu_seqlens, save_for_backward=save_for_backward, token_flags=token_flags)
    return _GatedDeltaProduct.apply(backend, options, q, k, v, g, beta, initial_state)


BACKEND_NAMES = ("auto", "reference", "cutedsl")


def resolve_backend(backend, q, k, v, num_householder: int):
    """The backend an op runs: ``backend`` as given (an instance), or by name — None / "auto": the
    CuTeDSL kernels on a Hopper GPU for a configuration they take, else the reference
    (``torch_api.gdp.cutedsl.auto_backend``); "reference": ``TorchGDPBackend``; "cutedsl": the kernels
    (falling back to the reference with a one-line warning where they cannot run)."""
    if backend is None or isinstance(backend, str):
        from torch_api.gdp.cutedsl import _auto_instance, auto_backend

        if backend in (None, "auto"):
            return auto_backend(q, k, v, num_householder)
        if backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be a backend instance or one of {BACKEND_NAMES}; received {backend!r}")
        return _auto_instance(backend)
    return backend
