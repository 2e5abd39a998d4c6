"""Weights of the NNX layers as the core's framework-neutral table (``cp_linear.weights``).

``state_table(module)`` exports ``{dotted name: numpy array}``; ``load_state_table(module, state)``
copies any table the core reads (a torch ``state_dict()`` or layer, a flat mapping of arrays, an
``nnx.State``, a Linen variables dict) into ``module`` after checking it against the one parameter
table (``cp_linear.model_config.parameter_shapes``). Nothing here imports torch.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from cp_linear.model_config import check_state, parameter_shapes
from cp_linear.weights import checked_table, flat_table


def flatten_jax_state(state) -> dict:
    """``{dotted name: numpy array}`` from an NNX module, an ``nnx.State``, a Linen ``{"params": ...}``
    dict (e.g. from ``nnx.bridge.ToLinen``), a nested dict / list pytree, or an already flat dict."""
    if isinstance(state, nnx.Module) and not hasattr(state, "state_table"):
        state = nnx.state(state, nnx.Param)
    return flat_table(state)


def jax_parameter_table(module: nnx.Module) -> dict[str, tuple[int, ...]]:
    """The table of a ``jax_api.layers`` module, checked against the module's own parameters."""
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(f"{type(module).__name__} has no .config; expected a GatedDeltaProduct, "
                         "BlockDiagAttention or HybridDecoder from jax_api.layers")
    expected = parameter_shapes(config)
    own = flat_table(nnx.state(module, nnx.Param))
    check_state(expected, {name: a.shape for name, a in own.items()}, what=f"{type(module).__name__}'s own parameters")
    return expected


def state_table(module: nnx.Module) -> dict[str, np.ndarray]:
    """``{dotted name: numpy copy}`` of the module's parameters, in the order of the table."""
    expected = jax_parameter_table(module)
    own = flat_table(nnx.state(module, nnx.Param))
    return {name: own[name] for name in expected}


def load_state_table(module: nnx.Module, state) -> nnx.Module:
    """Copy weights into ``module`` in place and return it.

    state: anything ``cp_linear.weights.flat_table`` reads (a torch ``state_dict()`` or a
    ``torch_api.layers`` module, a flat or nested ``{name: array}``, an ``nnx.State``, a Linen
    variables dict). Every parameter of the table must be present with its shape; missing, extra or
    mis-shaped entries raise one ValueError before anything is copied. Values keep the module's dtypes.
    """
    jax_parameter_table(module)
    table = checked_table(module.config, state, what="the state")
    params = dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))
    for path, variable in params.items():
        variable[...] = jnp.asarray(table[".".join(str(p) for p in path)], dtype=variable.dtype)
    nnx.update(module, nnx.from_flat_state(params))
    return module


class StateTableMixin:
    """``module.state_table()`` for the NNX layers (what ``cp_linear.weights.flat_table`` reads)."""

    def state_table(self) -> dict[str, np.ndarray]:
        return state_table(self)


load_torch_state_dict = load_state_table  # the name before the table moved to the core

__all__ = ["StateTableMixin", "flatten_jax_state", "jax_parameter_table", "load_state_table", "load_torch_state_dict",
           "state_table"]
