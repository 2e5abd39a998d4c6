"""The four-function protocol every chunkwise-CP backend implements (docs/design.md §2).

A frontend drives a backend like this, and owns every collective::

    summary, local = backend.cp_forward_prepare(inputs)          # zero incoming state
    gathered = all_gather(summary)                               # [cp, H, K, V + K]
    output, saved = backend.cp_forward_apply(local, gathered[preceding_rank_start:rank])
    ...
    summary, bwd = backend.cp_backward_prepare(output_grad, saved)   # zero outgoing gradient
    gathered = all_gather(summary)
    grads = backend.cp_backward_apply(bwd, gathered[rank + 1:following_rank_stop])

Summaries may be returned packed (one float32 tensor) or unpacked (two tensors, gathered
coalesced); ``preceding`` / ``following`` come back in the same form, stacked along a new
leading axis of length n ≥ 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Mapping, NamedTuple, Protocol, TypeVar, Union, runtime_checkable

from cp_linear.summary import (
    CPBackwardPackedSummary,
    CPBackwardUnpackedSummary,
    CPForwardPackedSummary,
    CPForwardUnpackedSummary,
)

TensorT = TypeVar("TensorT")
InputsT = TypeVar("InputsT")
LocalContextT = TypeVar("LocalContextT")
BackwardContextT = TypeVar("BackwardContextT")
InputGradsT = TypeVar("InputGradsT")

ForwardSummary = Union[CPForwardPackedSummary, CPForwardUnpackedSummary]
BackwardSummary = Union[CPBackwardPackedSummary, CPBackwardUnpackedSummary]


@dataclass
class CPSavedContext(Generic[TensorT]):
    """What the forward keeps for the backward.

    ``tensors`` go through the framework's saving mechanism (``ctx.save_for_backward`` in torch,
    residuals in JAX); ``metadata`` holds only Python values (ints, floats, bools, strings, tuples).
    """

    tensors: tuple[TensorT, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)


class CPForwardResult(NamedTuple, Generic[TensorT]):
    """Local output and the saved context; unpacks as ``output, saved_context``."""

    output: TensorT
    saved_context: CPSavedContext[TensorT]


@runtime_checkable
class LinearAttentionCPBackend(Protocol[InputsT, LocalContextT, BackwardContextT, InputGradsT, TensorT]):
    """Computes one rank's share of chunkwise CP; never sees a process group."""

    def cp_forward_prepare(self, inputs: InputsT) -> tuple[ForwardSummary, LocalContextT]:
        """Summary of the local shard with zero incoming state, and what apply needs."""
        ...

    def cp_forward_apply(self, local_context: LocalContextT, preceding: Any) -> CPForwardResult[TensorT]:
        """Fold ``preceding`` ([n, H, K, V + K]) into the incoming state; compute the local output."""
        ...

    def cp_backward_prepare(self, output_grad: TensorT, saved_context: CPSavedContext[TensorT]
                            ) -> tuple[BackwardSummary, BackwardContextT]:
        """Backward summary of the leading fragment with zero outgoing state-gradient."""
        ...

    def cp_backward_apply(self, backward_context: BackwardContextT, following: Any) -> InputGradsT:
        """Fold ``following`` (descending) into the outgoing state-gradient; return input gradients."""
        ...
