"""Inputs and gradients of one rank's GDP shard (``cp_linear.gdp``, shared with JAX) and the
float32 region every torch backend computes in."""

from __future__ import annotations

import contextlib

import torch

from cp_linear.gdp import GDPInputGradients, GDPInputs


def float32_region(device: torch.device):
    """Autocast off for the GDP math: the state and summaries are float32 by contract, and autocast
    would otherwise round the chunk matmuls (and hence the summaries) to its low-precision dtype."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def needs_backward(*tensors) -> bool:
    """True when autograd may ask for gradients through an op on ``tensors`` (grad mode on and one of
    them requires grad): ``GDPInputs.save_for_backward``. A constant under ``torch.compile`` (guarded)."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


__all__ = ["GDPInputGradients", "GDPInputs", "float32_region", "needs_backward"]
