"""Containment of non-finite GDP inputs when their values are not checked (``check_inputs=False``).

The chunked algorithm mixes steps through matmuls, where a masked-out NaN still poisons the sum
(0 * NaN = NaN): one NaN would reach every earlier token of its chunk and, through the chunk
recurrence, other sequences. So the op never lets a non-finite value into the math: inputs are
sanitised (NaN/Inf -> 0, by selection) and the outputs that truly depend on a non-finite input are
set to NaN afterwards::

    token       0 1 2 3 | 4 5 6 7        (two sequences, k[5] is NaN)
    poisoned    . . . . | . N N N        tokens 5..7 read the state after step 5; 0..4 never do

Per token t and head h: poisoned when q[t] is non-finite, or when any k, v, beta step or g of a
token s <= t of the same sequence is (the rule lives in ``cp_linear.validation``). Under CP a
sequence's poison crosses ranks inside its summary: a rank whose trailing fragment is poisoned
sends NaN in that head's summary, and the receiver turns a non-finite incoming state into poison
of its first sequence (and a zero state).
Gradients flow only from finite outputs (a poisoned output passes no gradient); sanitising passes the
gradient through unchanged (``sanitized``), which is zero at every replaced entry for that reason.

Cost per step, outside the kernels: one pass over the inputs that finds the bad tokens and writes their
sanitised copies (``contained_inputs``: the token-checks kernel, ``cp_linear.kernels.token_checks``, where
it takes the inputs; else one reduction, ``aminmax`` per row, and one ``nan_to_num`` pass), one select over
the output and one over its gradient; the rest works on bool [B, T, H]. With a backend that zeroes flagged
rows itself (``zeroes_flagged_rows``: the CuTeDSL kernel backend) where the token-checks kernel takes the
inputs, that pass only reads: the flags go to the backend with the unchanged inputs
(``GDPInputs.token_flags``), its contained chunk kernels zero the flagged rows as they load them, and the
one-device op leaves the NaN of the poisoned outputs and the zero of their gradient to them too (no select
over o and dO; the CP op keeps its select: poison from earlier ranks is known only after the exchange). As
``jax_api.gdp.isolation``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from cp_linear.validation import (
    gdp_bad_tokens,
    gdp_sequence_bad,
    gdp_token_poison,
    gdp_trailing_bad,
    nonfinite_rows,
    sanitize,
)
from cp_linear.validation import sequence_start_index as core_sequence_start_index
from torch_api import _prefix_counts  # noqa: F401  (the flag counts as a custom op: compiled steps)
from torch_api._poison import poison


def bad_tokens(q, k, v, g, beta, num_householder: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(state_bad, read_bad) bool [B, T, H] (``cp_linear.validation.gdp_bad_tokens``), without autograd.
    Under ``torch.compile`` through the opaque ``cp_linear::gdp_bad_tokens`` (same numbers): torch 2.11's
    Inductor fails to generate Triton for these row checks fused with the gate's softplus (issue 15)."""
    with torch.no_grad():
        if torch.compiler.is_compiling():
            return torch.ops.cp_linear.gdp_bad_tokens(q, k, v, g, beta, num_householder)
        return gdp_bad_tokens(q, k, v, g, beta, num_householder)


@torch.library.custom_op("cp_linear::gdp_bad_tokens", mutates_args=())
def bad_tokens_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  num_householder: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``gdp_bad_tokens`` as one op Inductor does not look into; bool outputs, so no autograd."""
    return gdp_bad_tokens(q, k, v, g, beta, num_householder)


@bad_tokens_op.register_fake
def _(q, k, v, g, beta, num_householder):
    return g.new_empty(g.shape, dtype=torch.bool), q.new_empty(q.shape[:3], dtype=torch.bool)


class _Sanitize(torch.autograd.Function):
    """``sanitize`` (NaN/Inf -> 0, one pass) whose gradient passes through unchanged.

    At a replaced entry that gradient is exactly zero anyway: the entry enters only outputs (and final
    states, and summaries under CP) that are poisoned, and a poisoned output passes no gradient, so every
    product that reaches the entry holds a zero factor. ``nan_to_num``'s own rule, ``grad * isfinite(x)``,
    gives the same numbers for five passes over each input (abs, ne, eq, mul, and a bf16 * bool multiply
    that casts: ``unrolled_elementwise_kernel``, 1.15 ms per step alone at 32k tokens on an H200)."""

    @staticmethod
    def forward(ctx, x):
        return sanitize(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def sanitized(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor with NaN/Inf replaced by 0 (differentiable: the gradient passes through unchanged, and is
    zero at the replaced entries because everything they reach is poisoned; ``_Sanitize``)."""
    return tuple(_Sanitize.apply(x) for x in tensors)


# --------------------------------------------------------------------------- flags and copies in one pass

def contained_inputs(q, k, v, g, beta, num_householder: int, *, backend=None
                     ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], tuple | None]:
    """(state_bad, read_bad, (q, k, v, g, beta), token_flags): ``bad_tokens`` (bool [B, T, H]) and the inputs
    the backend computes with.

    * ``backend`` zeroes flagged rows itself (``zeroes_flagged_rows``: the CuTeDSL kernel backend) and the
      token-checks kernel takes the inputs (``_token_checks_config``, ``_kernel_reads``): one flags-only
      launch (``_kernel_token_flags``); the inputs pass unchanged and ``token_flags`` (uint8 [B, T, H] each)
      goes to the backend in ``GDPInputs.token_flags``.
    * Else the inputs sanitised (the gradient passes through unchanged, ``sanitized``) and ``token_flags``
      None: one launch that also writes the copies where the kernel takes the inputs, else ``bad_tokens``
      and ``sanitized``.

    Under ``torch.compile`` the kernel paths are the opaque ops ``cp_linear::gdp_token_flags`` and
    ``cp_linear::gdp_contained_inputs``, which check at run time what they cannot while tracing (the
    platform, contiguity, alignment) and run the torch ops where the kernel cannot."""
    config = _token_checks_config(q, k, v, g, beta, num_householder)
    flags_only = config is not None and getattr(backend, "zeroes_flagged_rows", False)
    if torch.compiler.is_compiling():
        if flags_only and _compiled_kernel_device(q.device):
            with torch.no_grad():  # integer results: no gradient
                state_bad, read_bad = torch.ops.cp_linear.gdp_token_flags(q, k, v, g, beta, num_householder)
            return state_bad != 0, read_bad != 0, (q, k, v, g, beta), (state_bad, read_bad)
        if config is not None and _compiled_kernel_device(q.device):
            *clean, state_bad, read_bad = torch.ops.cp_linear.gdp_contained_inputs(q, k, v, g, beta, num_householder)
            return state_bad, read_bad, tuple(clean), None
    elif config is not None and _kernel_reads(q, k, v, g, beta):
        if flags_only:
            state_bad, read_bad = _kernel_token_flags(replace(config, copies=False), q, k, v, g, beta)
            return state_bad.view(torch.bool), read_bad.view(torch.bool), (q, k, v, g, beta), (state_bad, read_bad)
        state_bad, read_bad, *clean = _KernelContainedInputs.apply(config, q, k, v, g, beta)
        return state_bad, read_bad, tuple(clean), None
    state_bad, read_bad = bad_tokens(q, k, v, g, beta, num_householder)
    return state_bad, read_bad, sanitized(q, k, v, g, beta), None


def _token_checks_config(q, k, v, g, beta, num_householder: int):
    """The kernel's ``TokenChecksConfig`` when it takes these inputs (``launch.token_checks_config``: dtypes,
    head dims, n_h, int32 sizes) on one device; else None. Host values only (also while tracing)."""
    from cp_linear.kernels import launch as kl

    tensors = (q, k, v, g, beta)
    if q.dim() != 4 or any(x.device != q.device for x in tensors):
        return None
    return kl.token_checks_config(tuple(str(x.dtype).removeprefix("torch.") for x in tensors), q.shape[-1],
                                  v.shape[-1], num_householder, tuple(x.numel() for x in tensors))


def _compiled_kernel_device(device: torch.device) -> bool:
    """While tracing: whether the compiled graph takes the opaque kernel op (CUDA inputs; the op checks the
    platform when it runs)."""
    return device.type == "cuda"


def _kernel_reads(q, k, v, g, beta) -> bool:
    """The kernel runs on this device (``validation._kernel_platform_ready``: a Hopper GPU, the DSL, no
    tracing) and can read these tensors: contiguous (its row views), q, k, v 16-byte aligned (it reads
    16-byte vectors; a view into a larger tensor may not be)."""
    from torch_api.gdp import validation

    return (validation._kernel_platform_ready(q.device) and all(x.is_contiguous() for x in (q, k, v, g, beta))
            and all(x.data_ptr() % 16 == 0 for x in (q, k, v)))


def _kernel_contained_inputs(config, q, k, v, g, beta) -> tuple[torch.Tensor, ...]:
    """One ``TokenChecksLaunch`` on fresh outputs -> (state_bad, read_bad, q, k, v, g, beta sanitised); the
    inputs contiguous."""
    clean = [torch.empty_like(x) for x in (q, k, v, g, beta)]
    state_bad, read_bad = _launch_token_checks(config, (q, k, v, g, beta), clean)
    return (state_bad.view(torch.bool), read_bad.view(torch.bool), *clean)


def _kernel_token_flags(config, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """One flags-only ``TokenChecksLaunch`` (``config.copies`` False) -> (state_bad, read_bad) uint8 [B, T, H];
    the copies' arguments are one-row placeholders the kernel never writes. The inputs contiguous."""
    from torch_api.gdp.cutedsl import _placeholder

    heads = q.shape[2]
    unwritten = [_placeholder(x.device, x.dtype, (1, x.shape[-1])) for x in (q, k, v)]
    unwritten += [_placeholder(x.device, x.dtype, (1, heads)) for x in (g, beta)]
    return _launch_token_checks(config, (q, k, v, g, beta), unwritten)


def _launch_token_checks(config, inputs, outputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``TokenChecksLaunch`` of ``inputs`` (q, k, v, g, beta) into ``outputs`` (their copies, or
    placeholders) -> fresh (state_bad, read_bad) uint8 [B, T, H]. DLPack exports no tensor that requires grad:
    the inputs are detached (a view made under no_grad still requires grad); fresh outputs need no detach."""
    from cp_linear.kernels import launch as kl

    q = inputs[0]
    heads = q.shape[2]
    state_bad, read_bad = (torch.empty(q.shape[:3], dtype=torch.uint8, device=q.device) for _ in range(2))

    def rows(x):  # [rows, D/8, 8]
        return x.view(-1, x.shape[-1] // config.vector, config.vector)

    def by_head(x):  # [rows, H]
        return x.view(-1, heads)

    q, k, v, g, beta = (x.detach() for x in inputs)
    kl.TokenChecksLaunch(config, rows(q), rows(k), rows(v), by_head(g), by_head(beta), by_head(state_bad),
                         by_head(read_bad), *(rows(x) for x in outputs[:3]), by_head(outputs[3]),
                         by_head(outputs[4])).run()
    return state_bad, read_bad


class _KernelContainedInputs(torch.autograd.Function):
    """The token-checks kernel in eager mode (the custom op's dispatch layers cost host time); the gradient
    passes through the sanitising unchanged, as ``_Sanitize``'s. Gradients are not materialised: autograd
    would otherwise fill zeros for the two bool flags' gradients every backward (two allocations and two
    fill launches for nothing) and for a clean input that gets no gradient (passed on as None instead)."""

    @staticmethod
    def forward(ctx, config, q, k, v, g, beta):
        state_bad, read_bad, *clean = _kernel_contained_inputs(config, q, k, v, g, beta)
        ctx.mark_non_differentiable(state_bad, read_bad)
        ctx.set_materialize_grads(False)
        return state_bad, read_bad, *clean

    @staticmethod
    def backward(ctx, d_state_bad, d_read_bad, dq, dk, dv, dg, dbeta):
        return None, dq, dk, dv, dg, dbeta


@torch.library.custom_op("cp_linear::gdp_contained_inputs", mutates_args=())
def contained_inputs_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        num_householder: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                       torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, g, beta sanitised, state_bad, read_bad) as one op Inductor does not look into: the
    token-checks kernel where it takes the inputs, else ``gdp_bad_tokens`` and ``sanitize``. The
    differentiable outputs come first (opcheck's autograd test sums the outputs in order, which fails
    for a bool sum followed by a float one)."""
    config = _token_checks_config(q, k, v, g, beta, num_householder)
    if config is not None and _kernel_reads(q, k, v, g, beta):
        state_bad, read_bad, *clean = _kernel_contained_inputs(config, q, k, v, g, beta)
    else:
        state_bad, read_bad = gdp_bad_tokens(q, k, v, g, beta, num_householder)
        clean = [sanitize(x) for x in (q, k, v, g, beta)]
    return (*clean, state_bad, read_bad)


@contained_inputs_op.register_fake
def _(q, k, v, g, beta, num_householder):
    return (*(torch.empty_like(x) for x in (q, k, v, g, beta)), g.new_empty(g.shape, dtype=torch.bool),
            q.new_empty(q.shape[:3], dtype=torch.bool))


def _contained_inputs_backward(ctx, dq, dk, dv, dg, dbeta, d_state_bad, d_read_bad):
    return dq, dk, dv, dg, dbeta, None  # sanitising passes the gradient through (``_Sanitize``)


contained_inputs_op.register_autograd(_contained_inputs_backward)


@torch.library.custom_op("cp_linear::gdp_token_flags", mutates_args=())
def token_flags_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   num_householder: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(state_bad, read_bad) uint8 [B, T, H] as one op Inductor does not look into: the flags-only token-checks
    launch where the kernel takes the inputs, else ``gdp_bad_tokens``. Integer outputs, so no autograd."""
    config = _token_checks_config(q, k, v, g, beta, num_householder)
    if config is not None and _kernel_reads(q, k, v, g, beta):
        return _kernel_token_flags(replace(config, copies=False), q, k, v, g, beta)
    state_bad, read_bad = gdp_bad_tokens(q, k, v, g, beta, num_householder)
    return state_bad.to(torch.uint8), read_bad.to(torch.uint8)


@token_flags_op.register_fake
def _(q, k, v, g, beta, num_householder):
    return g.new_empty(g.shape, dtype=torch.uint8), q.new_empty(q.shape[:3], dtype=torch.uint8)


def sequence_start_index(tokens: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """int64 [T]: index of the first token of each token's sequence (0 for every token of a row)."""
    if cu_seqlens is None:
        return torch.zeros(tokens, dtype=torch.int64, device=device)
    return core_sequence_start_index(cu_seqlens.to(device=device, dtype=torch.int64), tokens)


def token_poison(state_bad, read_bad, start, incoming_bad=None) -> torch.Tensor:
    with torch.no_grad():
        return gdp_token_poison(state_bad, read_bad, start, incoming_bad)


def trailing_bad(state_bad, start) -> torch.Tensor:
    with torch.no_grad():
        return gdp_trailing_bad(state_bad, start)


def sequence_bad(state_bad, cu_seqlens) -> torch.Tensor:
    with torch.no_grad():
        cu = None if cu_seqlens is None else cu_seqlens.to(device=state_bad.device, dtype=torch.int64)
        return gdp_sequence_bad(state_bad, cu)


def poison_summary(summary, bad: torch.Tensor):
    """NaN in the heads (and rows) of a summary whose fragment is poisoned; bad bool [B, H] for a
    [B, H, K, V + K] summary, [1, H] for a packed [H, K, V + K] one. Any summary form."""
    from dataclasses import fields, is_dataclass, replace

    def mark(tensor):
        mask = bad.reshape(*bad.shape[1 if tensor.dim() == 3 else 0:], 1, 1)
        return poison(tensor, mask.to(tensor.device))

    if isinstance(summary, torch.Tensor):
        return mark(summary)
    if is_dataclass(summary):
        return replace(summary, **{f.name: mark(getattr(summary, f.name)) for f in fields(summary)})
    return summary


def incoming_bad_and_clean(stacked) -> tuple[torch.Tensor, object]:
    """Of sliced neighbour summaries [n, (B,) H, K, V + K] (any form): which (rows,) heads hold a
    non-finite value, bool [B or 1, H], and the summaries with those values zeroed."""
    from dataclasses import fields, is_dataclass, replace

    tensors = [stacked] if isinstance(stacked, torch.Tensor) else [getattr(stacked, f.name) for f in fields(stacked)]
    with torch.no_grad():
        bad = None
        for tensor in tensors:
            rows = nonfinite_rows(tensor, 2).any(0) if tensor.shape[0] else torch.zeros(
                tensor.shape[1:-2], dtype=torch.bool, device=tensor.device)
            bad = rows if bad is None else bad | rows
        bad = bad.reshape(-1, bad.shape[-1])
    if isinstance(stacked, torch.Tensor):
        return bad, sanitize(stacked)
    if is_dataclass(stacked):
        return bad, replace(stacked, **{f.name: sanitize(getattr(stacked, f.name)) for f in fields(stacked)})
    return bad, stacked


__all__ = ["bad_tokens", "bad_tokens_op", "contained_inputs", "contained_inputs_op", "incoming_bad_and_clean",
           "poison_summary", "sanitized", "sequence_bad", "sequence_start_index", "token_flags_op", "token_poison",
           "trailing_bad"]
