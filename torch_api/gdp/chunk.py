"""``TorchGDPBackend``: the four-function CP protocol for Gated DeltaProduct in pure torch.

Chunked WY/UT algorithm (``torch_api.gdp.wy``): the per-chunk math runs vectorised over all
chunks; only the chunk-to-chunk state recurrence is a Python loop over chunks (one batched
matmul per chunk). State, summaries and all internal math are float32 (IEEE matmuls, no TF32);
fp32 / bf16 / fp16 inputs are upcast, outputs and gradients come back in the input dtypes.
Runs on CPU and CUDA, deterministically (no atomics, fixed reduction order).

Backward: the chunk-to-chunk *state-gradient* recurrence is hand-written (the adjoint of the
forward loop, ``wy.backward_state_grads``); the gradients of each chunk's own math come from one
``torch.autograd.grad`` over a vectorised recomputation of ``wy.chunk_terms``, with the states
held constant. That keeps the backward exact and short (no hand-derived WY gradients) while the
autograd graph has no Python loop in it. Nothing but the inputs is saved between forward and
backward (recompute-friendly).

Contexts (stable: the CuTeDSL backend reuses this backend's backward)
  forward local context  ``TorchGDPForwardContext``
  saved context          ``CPSavedContext`` built by ``make_cp_saved_context``:
      tensors  = (q, k, v, g, beta, cu_seqlens | None, incoming_state, summary_transition,
                  initial_state | None)          (8 tensors, without the last, are read as well)
      metadata = {"scale": float, "num_householder": int, "use_qk_l2norm_in_kernel": bool,
                  "output_final_state": bool}
      incoming_state      float32 [H, K, V] (packed, cu_seqlens given) or [B, H, K, V] (rows)
      summary_transition  float32 [H, K, K] or [B, H, K, K]: M of the forward summary
  backward context       ``TorchGDPBackwardContext``

Sequence states (``GDPInputs.initial_state`` / ``output_final_state``, cp_linear.gdp): the one-device
op ``torch_api.gated_delta_product`` runs through the same four functions with empty neighbour
stacks; every local sequence starts from its initial state, ``cp_forward_apply`` returns
``(o, final_state)`` and ``cp_backward_prepare`` takes ``(do, d_final_state)``. Under CP (the
frontends' ``initial_state``) the preceding summaries are folded starting from the first local
sequence's initial state (summaries never carry it: E is computed from a zero incoming state), and
its ``dinitial_state`` row is the gradient of the shard's incoming state.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from cp_linear.protocol import CPForwardResult, CPSavedContext
from cp_linear.summary import (
    CPBackwardPackedSummary,
    CPForwardPackedSummary,
    compose_backward,
    compose_forward,
)
from cp_linear.chunking import CHUNK_SIZE
from cp_linear.gdp import GDPInputGradients, GDPInputs
from torch_api.gdp.validation import check_gdp_inputs
from torch_api.gdp.wy import (
    ChunkPlacement,
    ChunkTerms,
    backward_state_grads,
    chunk_terms,
    fold_summary,
    forward_states,
    l2norm,
    last_steps,
    on_first_step,
    on_last_step,
)



@contextmanager
def ieee_fp32_matmul(device: torch.device):
    """float32 matmuls at full precision on CUDA (no TF32) for the duration; a no-op on CPU."""
    if device.type != "cuda":
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


# --------------------------------------------------------------------------- saved contexts


def _metadata(inputs: GDPInputs) -> dict:
    return {"scale": float(inputs.scale), "num_householder": int(inputs.num_householder),
            "use_qk_l2norm_in_kernel": bool(inputs.use_qk_l2norm_in_kernel),
            "output_final_state": bool(inputs.output_final_state)}


def make_cp_saved_context(inputs: GDPInputs, incoming_state: torch.Tensor,
                          summary_transition: torch.Tensor) -> CPSavedContext:
    """What ``cp_forward_apply`` returns for ``TorchGDPBackend.cp_backward_prepare`` (see module doc)."""
    return CPSavedContext(
        tensors=(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.cu_seqlens,
                 incoming_state, summary_transition, inputs.initial_state),
        metadata=_metadata(inputs))


def read_cp_saved_context(saved: CPSavedContext) -> tuple[GDPInputs, torch.Tensor, torch.Tensor]:
    """-> (inputs, incoming_state, summary_transition); ``inputs.initial_state`` as saved."""
    if len(saved.tensors) not in (8, 9):
        raise ValueError(f"expected a GDP CP saved context with 8 or 9 tensors; received {len(saved.tensors)}")
    q, k, v, g, beta, cu_seqlens, incoming, transition = saved.tensors[:8]
    initial = saved.tensors[8] if len(saved.tensors) == 9 else None
    metadata = saved.metadata
    inputs = GDPInputs(q, k, v, g, beta, metadata["scale"], metadata["num_householder"],
                       metadata["use_qk_l2norm_in_kernel"], cu_seqlens, initial,
                       bool(metadata.get("output_final_state", False)))
    return inputs, incoming, transition


# --------------------------------------------------------------------------- one shard, chunked


@dataclass
class ChunkProblem:
    """One shard laid out in chunks, with its per-chunk terms.

    leaves  the five inputs (as fresh autograd leaves when built with ``requires_grad``)
    terms   ``ChunkTerms`` (carrying a graph back to ``leaves`` when built with ``requires_grad``)
    """

    inputs: GDPInputs
    layout: ChunkPlacement
    leaves: tuple[torch.Tensor, ...]
    terms: ChunkTerms

    @classmethod
    def build(cls, inputs: GDPInputs, chunk_size: int, *, requires_grad: bool) -> "ChunkProblem":
        leaves = (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)
        if requires_grad:
            leaves = tuple(x.detach().requires_grad_() for x in leaves)
        q, k, v, g, beta = (x.float() for x in leaves)
        if inputs.use_qk_l2norm_in_kernel:
            q, k = l2norm(q), l2norm(k)
        n = inputs.num_householder
        q, g = on_last_step(q, n), on_first_step(g, n)
        batch, steps = k.shape[:2]
        layout = ChunkPlacement.build(batch, steps, n, inputs.cu_seqlens, chunk_size, k.device)
        terms = chunk_terms(*(layout.to_chunks(x) for x in (q, k, v, g, beta)), float(inputs.scale))
        return cls(inputs, layout, leaves, terms)

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """[B, H, K, V] of the recurrence (B = 1 for a packed batch)."""
        return (self.layout.batch, self.inputs.q.shape[2], self.inputs.k.shape[-1], self.inputs.v.shape[-1])

    def outputs(self, states: torch.Tensor) -> torch.Tensor:
        """o [B, T, H, V] in q's dtype from the states entering each chunk ([NC + 1, B, H, K, V])."""
        terms = self.terms
        per_chunk = torch.baddbmm(terms.local_output.flatten(0, 2), terms.state_read.flatten(0, 2),
                                  states[:-1].flatten(0, 2)).view(terms.local_output.shape)
        per_step = self.layout.from_chunks(per_chunk)
        return last_steps(per_step, self.inputs.num_householder).to(self.inputs.q.dtype)

    def output_grads_to_chunks(self, output_grad: torch.Tensor | None) -> torch.Tensor:
        """do [B, T, H, V] -> float32 [NC, B, H, C, V] on the steps where q is read (zeros for None)."""
        if output_grad is None:
            return torch.zeros_like(self.terms.local_output)
        expected = (*self.inputs.q.shape[:3], self.inputs.v.shape[-1])
        if tuple(output_grad.shape) != expected:
            raise ValueError(f"output_grad must have shape {expected}; received {tuple(output_grad.shape)}")
        steps = on_last_step(output_grad.float(), self.inputs.num_householder)
        return self.layout.to_chunks(steps)

    def input_grads(self, states: torch.Tensor, output_grads: torch.Tensor, end_grads: torch.Tensor
                    ) -> GDPInputGradients:
        """Gradients of the five inputs for cotangents ``output_grads`` on every chunk's outputs and
        ``end_grads`` ([NC, B, H, K, V]) on every chunk's end state, the states held constant."""
        entering_t = states[:-1].transpose(-1, -2)
        terms = self.terms
        grads = torch.autograd.grad(
            (terms.state_read, terms.local_output, terms.transition, terms.update),
            self.leaves,
            (output_grads @ entering_t, output_grads, end_grads @ entering_t, end_grads),
        )
        return GDPInputGradients(*grads)

    def initial_states(self) -> torch.Tensor | None:
        """float32 [N, H, K, V] of ``inputs.initial_state`` (checked), or None."""
        initial = self.inputs.initial_state
        if initial is None:
            return None
        expected = self.inputs.state_shape
        if tuple(initial.shape) != expected:
            raise ValueError(f"initial_state must be [N, H, K, V] = {expected}; received {tuple(initial.shape)}")
        return initial.detach().float()

    def resets(self, initial: torch.Tensor | None) -> torch.Tensor | None:
        """States that sequences starting after chunk 0 begin from ([NC, B, H, K, V]), or None (zeros)."""
        return None if initial is None else self.layout.initial_and_resets(initial)[1]

    def entering_state(self, initial: torch.Tensor | None) -> torch.Tensor | None:
        """The initial state of the sequence that chunk 0 continues, in the summary's form, or None."""
        if initial is None:
            return None
        return _packed_form(self.layout.initial_and_resets(initial)[0], self.inputs)


def _packed_form(x: torch.Tensor, inputs: GDPInputs) -> torch.Tensor:
    """[B, H, ...] recurrence coordinates -> the summary's form: [H, ...] for a packed batch."""
    return x[0] if inputs.cu_seqlens is not None else x


def _stacked_count(stacked) -> int:
    if stacked is None:
        return 0
    first = stacked if isinstance(stacked, torch.Tensor) else next(iter(vars(stacked).values()))
    return int(first.shape[0])


# --------------------------------------------------------------------------- the backend


@dataclass
class TorchGDPForwardContext:
    """Between ``cp_forward_prepare`` and ``cp_forward_apply``: the chunk terms (no graph), M and the
    checked initial states (or None)."""

    problem: ChunkProblem
    summary_transition: torch.Tensor
    initial: torch.Tensor | None = None


@dataclass
class TorchGDPBackwardContext:
    """Between ``cp_backward_prepare`` and ``cp_backward_apply``.

    problem        chunk terms with an autograd graph back to fresh leaves of the inputs
    output_grads   float32 [NC, B, H, C, V]
    read_grads     float32 [NC, B, H, K, V]: what each chunk's outputs add to its state gradient
    incoming_state float32 [B, H, K, V]
    state_grads, end_grads   the state-gradient recurrence run from a zero outgoing gradient
    initial, final_grad      float32 [N, H, K, V] initial states and final-state gradient, or None
    """

    problem: ChunkProblem
    output_grads: torch.Tensor
    read_grads: torch.Tensor
    incoming_state: torch.Tensor
    state_grads: torch.Tensor
    end_grads: torch.Tensor
    initial: torch.Tensor | None = None
    final_grad: torch.Tensor | None = None


class TorchGDPBackend:
    """Pure-torch chunkwise-CP backend for GDP (``cp_linear.protocol.LinearAttentionCPBackend``).

    Summaries are returned packed: forward ``[E | M]``, backward ``[gamma | M^T]``, float32
    [H, K, V + K] for a packed batch (``inputs.cu_seqlens`` given) or [B, H, K, V + K] for rows.
    Supports the sequence states of ``cp_linear.gdp.GDPInputs`` (``supports_sequence_states``), which
    the one-device op ``torch_api.gated_delta_product`` uses.
    """

    supports_sequence_states = True

    def __init__(self, chunk_size: int = CHUNK_SIZE):
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int; received {chunk_size!r}")
        self.chunk_size = chunk_size

    @staticmethod
    def _check(inputs: GDPInputs) -> None:
        check_gdp_inputs(inputs)

    # ---- forward

    def cp_forward_prepare(self, inputs: GDPInputs) -> tuple[CPForwardPackedSummary, TorchGDPForwardContext]:
        self._check(inputs)
        with ieee_fp32_matmul(inputs.q.device), torch.no_grad():
            problem = ChunkProblem.build(inputs, self.chunk_size, requires_grad=False)
            initial = problem.initial_states()
            summary = fold_summary(problem.terms.transition, problem.terms.update, keep=problem.layout.keep,
                                   resets=problem.resets(initial))
        summary = _packed_form(summary, inputs)
        value_dim = inputs.v.shape[-1]
        return (CPForwardPackedSummary(summary),
                TorchGDPForwardContext(problem, summary[..., value_dim:], initial))

    def cp_forward_apply(self, local_context: TorchGDPForwardContext, preceding) -> CPForwardResult:
        problem, initial = local_context.problem, local_context.initial
        inputs = problem.inputs
        with ieee_fp32_matmul(inputs.q.device), torch.no_grad():
            incoming = self._fold(compose_forward, preceding, problem, start=problem.entering_state(initial))
            terms = problem.terms
            states = forward_states(terms.transition, terms.update, incoming.view(problem.state_shape),
                                    keep=problem.layout.keep, resets=problem.resets(initial))
            output = problem.outputs(states)
            if inputs.output_final_state:
                start = initial if initial is not None else terms.update.new_zeros(inputs.state_shape)
                output = (output, problem.layout.final_states(terms.transition, terms.update, states, start))
        saved = make_cp_saved_context(inputs, incoming, local_context.summary_transition)
        return CPForwardResult(output, saved)

    def _fold(self, compose, stacked, problem: ChunkProblem, start: torch.Tensor | None = None) -> torch.Tensor:
        """Fold gathered summaries into a state (gradient) in the summary's form, from ``start``
        (zeros when None)."""
        expected = _packed_form(torch.empty(problem.state_shape, device="meta"), problem.inputs).shape
        if _stacked_count(stacked) == 0:
            if start is not None:
                return start.float()
            return torch.zeros(expected, dtype=torch.float32, device=problem.inputs.q.device)
        folded = compose(stacked) if start is None else compose(stacked, start)
        if folded.shape != expected:
            raise ValueError(f"summaries fold to shape {tuple(folded.shape)}; expected {tuple(expected)}")
        return folded.float()

    # ---- backward

    def cp_backward_prepare(self, output_grad, saved_context: CPSavedContext
                            ) -> tuple[CPBackwardPackedSummary, TorchGDPBackwardContext]:
        inputs, incoming, transition = read_cp_saved_context(saved_context)
        output_grad, final_grad = output_grad if inputs.output_final_state else (output_grad, None)
        with ieee_fp32_matmul(inputs.q.device):
            with torch.enable_grad():
                problem = ChunkProblem.build(inputs, self.chunk_size, requires_grad=True)
            with torch.no_grad():
                initial = problem.initial_states()
                if final_grad is not None:
                    final_grad = final_grad.float()
                terms = problem.terms.detached()
                output_grads = problem.output_grads_to_chunks(output_grad)
                read_grads = terms.state_read.transpose(-1, -2) @ output_grads
                state_grads, end_grads = self._state_grads(problem, read_grads, final_grad, outgoing=None)
                gamma = _packed_form(state_grads[0], inputs)
                summary = torch.cat([gamma, transition.transpose(-1, -2)], dim=-1)
        context = TorchGDPBackwardContext(problem, output_grads, read_grads, incoming.view(problem.state_shape),
                                          state_grads, end_grads, initial, final_grad)
        return CPBackwardPackedSummary(summary), context

    @staticmethod
    def _state_grads(problem: ChunkProblem, read_grads, final_grad, outgoing):
        """The state-gradient recurrence from the outgoing gradient (zeros when None) and dL/d(final states)."""
        layout, terms = problem.layout, problem.terms
        after_last, inject = read_grads.new_zeros(problem.state_shape), None
        if final_grad is not None:
            after_last, inject = layout.final_state_grads(final_grad)
        if outgoing is not None:
            after_last = after_last + outgoing
        return backward_state_grads(terms.transition.detach(), read_grads, after_last, keep=layout.keep,
                                    inject=inject)

    def cp_backward_apply(self, backward_context: TorchGDPBackwardContext, following) -> GDPInputGradients:
        ctx = backward_context
        problem = ctx.problem
        with ieee_fp32_matmul(problem.inputs.q.device):
            with torch.no_grad():
                terms = problem.terms.detached()
                state_grads, end_grads = ctx.state_grads, ctx.end_grads
                if _stacked_count(following) > 0:  # else the zero-gradient run of prepare is the answer
                    outgoing = self._fold(compose_backward, following, problem).view(problem.state_shape)
                    state_grads, end_grads = self._state_grads(problem, ctx.read_grads, ctx.final_grad, outgoing)
                states = forward_states(terms.transition, terms.update, ctx.incoming_state,
                                        keep=problem.layout.keep, resets=problem.resets(ctx.initial))
            grads = problem.input_grads(states, ctx.output_grads, end_grads)
        if ctx.initial is None:
            return grads
        return grads._replace(dinitial_state=problem.layout.initial_state_grads(state_grads, ctx.final_grad))

    # ---- one device (through the four functions; what torch_api.gated_delta_product runs)

    def one_device_forward(self, inputs: GDPInputs, initial_state: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, CPSavedContext]:
        """-> (o [B, T, H, V], final_state float32 [N, H, K, V], saved context): the four functions
        with no neighbours."""
        inputs = replace(inputs, initial_state=initial_state, output_final_state=True)
        _, local = self.cp_forward_prepare(inputs)
        (output, final_state), saved = self.cp_forward_apply(local, None)
        return output, final_state, saved

    def one_device_backward(self, output_grad: torch.Tensor | None, final_state_grad: torch.Tensor | None,
                            saved_context: CPSavedContext) -> tuple[GDPInputGradients, torch.Tensor | None]:
        """-> (input gradients, dL/d initial_state float32 [N, H, K, V] or None) for a
        ``one_device_forward`` context."""
        _, context = self.cp_backward_prepare((output_grad, final_state_grad), saved_context)
        grads = self.cp_backward_apply(context, None)
        return grads._replace(dinitial_state=None), grads.dinitial_state
