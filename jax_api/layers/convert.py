"""Weights between the JAX and torch layers: ``load_torch_state_dict(module, state_dict)`` (torch -> JAX).

Both frameworks hold the same parameters under the same dotted names and shapes
(``cp_linear.model_config.parameter_shapes``), so conversion is a checked name-for-name copy.
The reverse direction is ``torch_api.load_jax_state``; ``flatten_jax_state`` serves it.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from cp_linear.model_config import check_state, parameter_shapes


def _flatten_nested(tree, prefix: str, out: dict) -> None:
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            _flatten_nested(value, f"{prefix}{key}.", out)
        return
    if isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            _flatten_nested(value, f"{prefix}{index}.", out)
        return
    if isinstance(tree, nnx.Variable):
        tree = tree[...]
    out[prefix[:-1]] = tree


def flatten_jax_state(state) -> dict:
    """``{dotted name: array}`` from an NNX module, an ``nnx.State``, a Linen ``{"params": ...}`` dict
    (e.g. from ``nnx.bridge.ToLinen``), a nested dict / list pytree, or an already flat dict."""
    if isinstance(state, nnx.Module):
        state = nnx.state(state, nnx.Param)
    if isinstance(state, nnx.State):
        state = nnx.to_pure_dict(state)
    if isinstance(state, Mapping) and set(state) == {"params"}:
        state = state["params"]
    if not isinstance(state, Mapping):
        raise ValueError(f"expected an NNX module, nnx.State or a dict of arrays; received {type(state).__name__}")
    flat: dict = {}
    _flatten_nested(state, "", flat)
    return {name: value for name, value in flat.items() if value is not None}


def jax_parameter_table(module: nnx.Module) -> dict[str, tuple[int, ...]]:
    """The table of a ``jax_api.layers`` module, checked against the module's own parameters."""
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(f"{type(module).__name__} has no .config; expected a GatedDeltaProduct, "
                         "BlockDiagAttention or HybridDecoder from jax_api.layers")
    expected = parameter_shapes(config)
    own = flatten_jax_state(module)
    check_state(expected, {name: tuple(np.shape(a)) for name, a in own.items()},
                what=f"{type(module).__name__}'s own parameters")
    return expected


def _to_numpy(value) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor, without importing torch
        value = value.detach().cpu()
        if str(value.dtype) in ("torch.bfloat16", "torch.float16"):
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def load_torch_state_dict(module: nnx.Module, state_dict: Mapping) -> nnx.Module:
    """Copy a torch ``state_dict()`` (or any ``{dotted name: array}``) into ``module`` in place; return it.

    Every parameter of the table must be present with its shape; missing, extra or mis-shaped
    entries raise one ValueError before anything is copied. Values keep the module's dtypes.
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict must be a mapping of names to tensors; received {type(state_dict).__name__}")
    expected = jax_parameter_table(module)
    arrays = {name: _to_numpy(value) for name, value in state_dict.items()}
    check_state(expected, {name: a.shape for name, a in arrays.items()}, what="the torch state dict")
    params = dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))
    for path, variable in params.items():
        name = ".".join(str(p) for p in path)
        variable[...] = jnp.asarray(arrays[name], dtype=variable.dtype)
    nnx.update(module, nnx.from_flat_state(params))
    return module


__all__ = ["flatten_jax_state", "jax_parameter_table", "load_torch_state_dict"]
