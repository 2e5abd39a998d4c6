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
      tensors  = (q, k, v, g, beta, cu_seqlens | None, incoming_state, summary_transition)
      metadata = {"scale": float, "num_householder": int, "use_qk_l2norm_in_kernel": bool}
      incoming_state      float32 [H, K, V] (packed, cu_seqlens given) or [B, H, K, V] (rows)
      summary_transition  float32 [H, K, K] or [B, H, K, K]: M of the forward summary
  backward context       ``TorchGDPBackwardContext``
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from cp_linear.protocol import CPForwardResult, CPSavedContext
from cp_linear.summary import (
    CPBackwardPackedSummary,
    CPForwardPackedSummary,
    compose_backward,
    compose_forward,
)
from torch_api.gdp.types import GDPInputGradients, GDPInputs
from torch_api.gdp.validation import check_gdp_inputs
from torch_api.gdp.wy import (
    ChunkLayout,
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

CHUNK_SIZE = 64


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
            "use_qk_l2norm_in_kernel": bool(inputs.use_qk_l2norm_in_kernel)}


def _inputs_from(tensors, metadata) -> GDPInputs:
    q, k, v, g, beta, cu_seqlens = tensors[:6]
    return GDPInputs(q, k, v, g, beta, metadata["scale"], metadata["num_householder"],
                     metadata["use_qk_l2norm_in_kernel"], cu_seqlens)


def make_cp_saved_context(inputs: GDPInputs, incoming_state: torch.Tensor,
                          summary_transition: torch.Tensor) -> CPSavedContext:
    """What ``cp_forward_apply`` returns for ``TorchGDPBackend.cp_backward_prepare`` (see module doc)."""
    return CPSavedContext(
        tensors=(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.cu_seqlens,
                 incoming_state, summary_transition),
        metadata=_metadata(inputs))


def read_cp_saved_context(saved: CPSavedContext) -> tuple[GDPInputs, torch.Tensor, torch.Tensor]:
    """-> (inputs, incoming_state, summary_transition)."""
    if len(saved.tensors) != 8:
        raise ValueError(f"expected a GDP CP saved context with 8 tensors; received {len(saved.tensors)}")
    return _inputs_from(saved.tensors, saved.metadata), saved.tensors[6], saved.tensors[7]


# --------------------------------------------------------------------------- one shard, chunked


@dataclass
class ChunkProblem:
    """One shard laid out in chunks, with its per-chunk terms.

    leaves  the five inputs (as fresh autograd leaves when built with ``requires_grad``)
    terms   ``ChunkTerms`` (carrying a graph back to ``leaves`` when built with ``requires_grad``)
    """

    inputs: GDPInputs
    layout: ChunkLayout
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
        layout = ChunkLayout.build(batch, steps, n, inputs.cu_seqlens, chunk_size, k.device)
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
    """Between ``cp_forward_prepare`` and ``cp_forward_apply``: the chunk terms (no graph) and M."""

    problem: ChunkProblem
    summary_transition: torch.Tensor


@dataclass
class TorchGDPBackwardContext:
    """Between ``cp_backward_prepare`` and ``cp_backward_apply``.

    problem        chunk terms with an autograd graph back to fresh leaves of the inputs
    output_grads   float32 [NC, B, H, C, V]
    read_grads     float32 [NC, B, H, K, V]: what each chunk's outputs add to its state gradient
    incoming_state float32 [B, H, K, V]
    state_grads, end_grads   the state-gradient recurrence run from a zero outgoing gradient
    """

    problem: ChunkProblem
    output_grads: torch.Tensor
    read_grads: torch.Tensor
    incoming_state: torch.Tensor
    state_grads: torch.Tensor
    end_grads: torch.Tensor


class TorchGDPBackend:
    """Pure-torch chunkwise-CP backend for GDP (``cp_linear.protocol.LinearAttentionCPBackend``).

    Summaries are returned packed: forward ``[E | M]``, backward ``[gamma | M^T]``, float32
    [H, K, V + K] for a packed batch (``inputs.cu_seqlens`` given) or [B, H, K, V + K] for rows.
    ``one_device_forward`` / ``one_device_backward`` serve ``torch_api.gated_delta_product``.
    """

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
            summary = fold_summary(problem.terms.transition, problem.terms.update, keep=problem.layout.keep)
        summary = _packed_form(summary, inputs)
        value_dim = inputs.v.shape[-1]
        return CPForwardPackedSummary(summary), TorchGDPForwardContext(problem, summary[..., value_dim:])

    def cp_forward_apply(self, local_context: TorchGDPForwardContext, preceding) -> CPForwardResult:
        problem = local_context.problem
        inputs = problem.inputs
        with ieee_fp32_matmul(inputs.q.device), torch.no_grad():
            incoming = self._fold(compose_forward, preceding, problem)
            terms = problem.terms
            states = forward_states(terms.transition, terms.update, incoming.view(problem.state_shape),
                                    keep=problem.layout.keep)
            output = problem.outputs(states)
        saved = make_cp_saved_context(inputs, incoming, local_context.summary_transition)
        return CPForwardResult(output, saved)

    def _fold(self, compose, stacked, problem: ChunkProblem) -> torch.Tensor:
        """Fold gathered summaries into a state (gradient) in the summary's form; zeros when empty."""
        expected = _packed_form(torch.empty(problem.state_shape, device="meta"), problem.inputs).shape
        if _stacked_count(stacked) == 0:
            return torch.zeros(expected, dtype=torch.float32, device=problem.inputs.q.device)
        folded = compose(stacked)
        if folded.shape != expected:
            raise ValueError(f"summaries fold to shape {tuple(folded.shape)}; expected {tuple(expected)}")
        return folded.float()

    # ---- backward

    def cp_backward_prepare(self, output_grad: torch.Tensor, saved_context: CPSavedContext
                            ) -> tuple[CPBackwardPackedSummary, TorchGDPBackwardContext]:
        inputs, incoming, transition = read_cp_saved_context(saved_context)
        with ieee_fp32_matmul(inputs.q.device):
            with torch.enable_grad():
                problem = ChunkProblem.build(inputs, self.chunk_size, requires_grad=True)
            with torch.no_grad():
                terms = problem.terms.detached()
                output_grads = problem.output_grads_to_chunks(output_grad)
                read_grads = terms.state_read.transpose(-1, -2) @ output_grads
                zero = read_grads.new_zeros(problem.state_shape)
                state_grads, end_grads = backward_state_grads(terms.transition, read_grads, zero,
                                                              keep=problem.layout.keep)
                gamma = _packed_form(state_grads[0], inputs)
                summary = torch.cat([gamma, transition.transpose(-1, -2)], dim=-1)
        context = TorchGDPBackwardContext(problem, output_grads, read_grads, incoming.view(problem.state_shape),
                                          state_grads, end_grads)
        return CPBackwardPackedSummary(summary), context

    def cp_backward_apply(self, backward_context: TorchGDPBackwardContext, following) -> GDPInputGradients:
        ctx = backward_context
        problem = ctx.problem
        with ieee_fp32_matmul(problem.inputs.q.device):
            with torch.no_grad():
                terms = problem.terms.detached()
                end_grads = ctx.end_grads
                if _stacked_count(following) > 0:  # else the zero-gradient run of prepare is the answer
                    outgoing = self._fold(compose_backward, following, problem).view(problem.state_shape)
                    _, end_grads = backward_state_grads(terms.transition, ctx.read_grads, outgoing,
                                                        keep=problem.layout.keep)
                states = forward_states(terms.transition, terms.update, ctx.incoming_state,
                                        keep=problem.layout.keep)
            return problem.input_grads(states, ctx.output_grads, end_grads)

    # ---- one device (torch_api.gated_delta_product)

    def one_device_forward(self, inputs: GDPInputs, initial_state: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, CPSavedContext]:
        """-> (o [B, T, H, V], final_state float32 [N, H, K, V], saved context for the backward).

        initial_state [N, H, K, V] (N = number of sequences; zeros when None).
        saved.tensors = (q, k, v, g, beta, cu_seqlens | None, initial_state float32 | None).
        """
        self._check(inputs)
        with ieee_fp32_matmul(inputs.q.device), torch.no_grad():
            problem = ChunkProblem.build(inputs, self.chunk_size, requires_grad=False)
            initial = self._initial_states(problem, initial_state)
            states = self._states_from_initial(problem, initial)
            output = problem.outputs(states)
            final_state = problem.layout.final_states(problem.terms.transition, problem.terms.update, states)
        saved_initial = None if initial_state is None else initial
        saved = CPSavedContext(
            tensors=(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.cu_seqlens, saved_initial),
            metadata=_metadata(inputs))
        return output, final_state, saved

    def one_device_backward(self, output_grad: torch.Tensor | None, final_state_grad: torch.Tensor | None,
                            saved_context: CPSavedContext) -> tuple[GDPInputGradients, torch.Tensor]:
        """-> (input gradients, dL/d initial_state float32 [N, H, K, V])."""
        inputs = _inputs_from(saved_context.tensors, saved_context.metadata)
        with ieee_fp32_matmul(inputs.q.device):
            with torch.enable_grad():
                problem = ChunkProblem.build(inputs, self.chunk_size, requires_grad=True)
            layout = problem.layout
            with torch.no_grad():
                terms = problem.terms.detached()
                output_grads = problem.output_grads_to_chunks(output_grad)
                read_grads = terms.state_read.transpose(-1, -2) @ output_grads
                if final_state_grad is None:
                    after_last, inject = read_grads.new_zeros(problem.state_shape), None
                else:
                    after_last, inject = layout.final_state_grads(final_state_grad.float())
                state_grads, end_grads = backward_state_grads(terms.transition, read_grads, after_last,
                                                              keep=layout.keep, inject=inject)
                initial = self._initial_states(problem, saved_context.tensors[6])
                states = self._states_from_initial(problem, initial)
            grads = problem.input_grads(states, output_grads, end_grads)
        return grads, layout.initial_state_grads(state_grads)

    @staticmethod
    def _initial_states(problem: ChunkProblem, initial_state: torch.Tensor | None) -> torch.Tensor:
        batch, heads, key_dim, value_dim = problem.state_shape
        expected = (problem.layout.num_sequences, heads, key_dim, value_dim)
        if initial_state is None:
            return problem.terms.update.new_zeros(expected)
        if tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state must be [N, H, K, V] = {expected}; received {tuple(initial_state.shape)}")
        return initial_state.detach().float()

    @staticmethod
    def _states_from_initial(problem: ChunkProblem, initial: torch.Tensor) -> torch.Tensor:
        terms, layout = problem.terms.detached(), problem.layout
        first, resets = layout.initial_and_resets(initial)
        return forward_states(terms.transition, terms.update, first, keep=layout.keep, resets=resets)
