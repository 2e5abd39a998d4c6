"""Weights as a framework-neutral table: ``{dotted parameter name: numpy array}`` (no torch or jax here).

Both frontends hold the same parameters under the same dotted names and shapes
(``cp_linear.model_config.parameter_shapes``), so converting weights between them is: export a
table from one (``state_table``), check it against the config's table, copy it into the other
(``load_state_table``). Neither frontend imports the other; this module reads any of:

  * a flat ``{name: array}`` mapping (torch ``state_dict()``, a table, numpy / torch / jax arrays),
  * a nested mapping or list pytree (``nnx.State``, ``nnx.to_pure_dict``, a Linen variables dict
    ``{"params": ...}`` from ``nnx.bridge``), whose leaves may be arrays or NNX variables,
  * a module of either frontend's layers (anything with a ``state_table()`` method).

Arrays come out as numpy; bfloat16 / float16 tensors as float32 (numpy has no bfloat16).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from cp_linear.model_config import check_state, parameter_shapes


def to_numpy(value) -> np.ndarray:
    """A numpy copy of a numpy / torch / jax array or an NNX variable (no framework import)."""
    if callable(getattr(value, "get_value", None)):  # an NNX Variable
        value = value.get_value()
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor
        value = value.detach().cpu()
        if str(value.dtype) in ("torch.bfloat16", "torch.float16"):
            value = value.float()
        return value.numpy().copy()
    array = np.asarray(value)
    if array.dtype.name == "bfloat16":  # a jax / ml_dtypes bfloat16 array
        array = array.astype(np.float32)
    return np.array(array, copy=True)


def _flatten(tree, prefix: str, out: dict) -> None:
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            _flatten(value, f"{prefix}{key}.", out)
        return
    if isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            _flatten(value, f"{prefix}{index}.", out)
        return
    if tree is not None:
        out[prefix[:-1]] = to_numpy(tree)


def flat_table(state) -> dict[str, np.ndarray]:
    """``{dotted name: numpy array}`` from any of the forms in the module docstring."""
    if hasattr(state, "state_table") and callable(state.state_table):
        return state.state_table()
    if not isinstance(state, Mapping):
        raise ValueError(f"expected a mapping of names to arrays, a nested state (nnx.State, a Linen variables "
                         f"dict) or a layer with state_table(); received {type(state).__name__}")
    if set(state) == {"params"}:  # Linen variables
        state = state["params"]
    table: dict = {}
    _flatten(state, "", table)
    return table


def checked_table(config, state, *, what: str) -> dict[str, np.ndarray]:
    """The table of ``state``, checked against ``parameter_shapes(config)``: one ValueError listing every
    missing, unexpected or mis-shaped parameter, raised before anything is copied."""
    table = flat_table(state)
    check_state(parameter_shapes(config), {name: array.shape for name, array in table.items()}, what=what)
    return table


__all__ = ["checked_table", "flat_table", "to_numpy"]
