"""``cp_linear::prefix_counts``: the containment's flag counts (``cp_linear.validation.blocked_prefix_counts``) as
a torch custom op, so that a compiled step runs them as the eager cumsums. Inductor lowers a cumsum to its own
Triton scan, whose codegen failed on these (torch 2.11 on an H100, ``bench_train.py --compile``: "list indices
must be integers or slices, not NoneType" in a SplitScan); inside an op they are opaque to it. Importing this
module registers the op and routes ``validation._prefix_counts`` of torch tensors through it under torch.compile."""

from __future__ import annotations

import torch

from cp_linear import validation


@torch.library.custom_op("cp_linear::prefix_counts", mutates_args=())
def prefix_counts(flags: torch.Tensor) -> torch.Tensor:
    """int32 [..., T + 1]: the number of set ``flags[..., :t]`` (bool or 0/1 ints [..., T])."""
    return validation.blocked_prefix_counts(flags).contiguous()  # a slice of whole blocks: the fake's layout


@prefix_counts.register_fake
def _(flags: torch.Tensor) -> torch.Tensor:
    return flags.new_empty((*flags.shape[:-1], flags.shape[-1] + 1), dtype=torch.int32)


def _counts(flags: torch.Tensor) -> torch.Tensor:
    """The op while torch.compile traces; the plain scans in eager mode (no op dispatch per call)."""
    if torch.compiler.is_compiling():
        return prefix_counts(flags)
    return validation.blocked_prefix_counts(flags)


validation.register_torch_prefix_counts(_counts)
