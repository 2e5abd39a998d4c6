"""Weights between the torch and JAX layers: ``load_jax_state(module, state)`` (JAX -> torch, in place).

Both frameworks hold the same parameters under the same dotted names and shapes
(``cp_linear.model_config.parameter_shapes`` is the one table), so conversion is a checked
name-for-name copy with no transposes. The reverse direction is ``jax_api.load_torch_state_dict``.
"""

from __future__ import annotations

import numpy as np
import torch

from cp_linear.model_config import check_state, parameter_shapes


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


def load_jax_state(module: torch.nn.Module, state) -> torch.nn.Module:
    """Copy JAX weights into ``module`` in place and return it.

    state: the matching ``jax_api.layers`` NNX module, its ``nnx.State`` (``nnx.state(model)``), a
    Linen variables dict from ``nnx.bridge`` (``{"params": ...}``), a nested dict / pytree of
    arrays keyed by name, or a flat ``{dotted name: array}`` dict. Every parameter must be present
    with the shape of the table; extra or missing names raise ValueError before anything is copied.
    """
    from jax_api.layers.convert import flatten_jax_state

    expected = module_parameter_table(module)
    arrays = flatten_jax_state(state)
    check_state(expected, {name: tuple(np.shape(a)) for name, a in arrays.items()}, what="the JAX state")
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name in expected:
            host = np.asarray(arrays[name])
            params[name].copy_(torch.from_numpy(np.array(host, copy=True)).to(params[name].dtype))
    return module


def torch_state_arrays(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """``{dotted name: float32/64 numpy copy}`` of the module's parameters, checked against the table."""
    expected = module_parameter_table(module)
    params = dict(module.named_parameters())
    return {name: params[name].detach().cpu().float().numpy() if params[name].dtype in (torch.bfloat16, torch.float16)
            else params[name].detach().cpu().numpy() for name in expected}


__all__ = ["load_jax_state", "module_parameter_table", "torch_state_arrays"]
