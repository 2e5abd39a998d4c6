"""Weights of the torch layers as the core's framework-neutral table (``cp_linear.weights``).

``state_table(module)`` exports ``{dotted name: numpy array}``; ``load_state_table(module, state)``
copies any table the core reads (a JAX layer, its ``nnx.State``, a Linen variables dict, a flat
mapping of arrays) into ``module`` after checking it against the one parameter table
(``cp_linear.model_config.parameter_shapes``). Names and shapes agree across the frameworks, so
the copy has no transposes, and nothing here imports JAX.
"""

from __future__ import annotations

import numpy as np
import torch

from cp_linear.model_config import check_state, parameter_shapes
from cp_linear.weights import checked_table, to_numpy


def module_parameter_table(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The table of a layer / model built by ``torch_api.layers`` (it carries its ``config``)."""
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(f"{type(module).__name__} has no .config; expected a GatedDeltaProduct, "
                         "BlockDiagAttention or HybridDecoder from torch_api.layers")
    expected = parameter_shapes(config)
    check_state(expected, {name: tuple(p.shape) for name, p in module.named_parameters()},
                what=f"{type(module).__name__}'s own parameters")
    return expected


def state_table(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """``{dotted name: numpy copy}`` of the module's parameters (float32 for half precision), in the
    order of the table."""
    expected = module_parameter_table(module)
    params = dict(module.named_parameters())
    return {name: to_numpy(params[name]) for name in expected}


def load_state_table(module: torch.nn.Module, state) -> torch.nn.Module:
    """Copy weights into ``module`` in place and return it.

    state: anything ``cp_linear.weights.flat_table`` reads (a ``jax_api.layers`` module, its
    ``nnx.State``, a Linen variables dict, a nested or flat ``{name: array}``). Every parameter
    must be present with the shape of the table; extra or missing names raise ValueError before
    anything is copied. Values keep the module's dtypes.
    """
    module_parameter_table(module)
    table = checked_table(module.config, state, what="the state")
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, array in table.items():
            params[name].copy_(torch.from_numpy(array).to(params[name].dtype))
    return module


class StateTableMixin:
    """``module.state_table()`` for the torch layers (what ``cp_linear.weights.flat_table`` reads)."""

    def state_table(self) -> dict[str, np.ndarray]:
        return state_table(self)


load_jax_state = load_state_table  # the name before the table moved to the core
torch_state_arrays = state_table

__all__ = ["StateTableMixin", "load_jax_state", "load_state_table", "module_parameter_table", "state_table",
           "torch_state_arrays"]
