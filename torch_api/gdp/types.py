"""Inputs and gradients of one rank's GDP shard, as every torch backend sees them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


def float32_region(device: torch.device):
    """Autocast off for the GDP math: the state and summaries are float32 by contract, and autocast
    would otherwise round the chunk matmuls (and hence the summaries) to its low-precision dtype."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


@dataclass
class GDPInputs:
    """One shard of a Gated DeltaProduct layer (DESIGN.md §2 layouts).

    q     [B, T, H, K]
    k     [B, T*n_h, H, K]      the j-th key of token t at index t*n_h + j
    v     [B, T*n_h, H, V]
    g     [B, T, H]             natural-log decay, applied once per token
    beta  [B, T*n_h, H]
    cu_seqlens  int32 [N + 1] local sequence boundaries (B = 1 packed batch), or None when each
                batch row is one sequence (continuing across ranks)
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    scale: float
    num_householder: int = 1
    use_qk_l2norm_in_kernel: bool = False
    cu_seqlens: torch.Tensor | None = None


@dataclass
class GDPInputGradients:
    """Gradients with the shapes and dtypes of the matching ``GDPInputs`` fields."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
