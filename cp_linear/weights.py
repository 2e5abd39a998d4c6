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

from cp_linear.model_config import DecoderConfig, check_state, parameter_shapes


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


def _decay_init(rng: np.random.Generator, heads: int) -> tuple[np.ndarray, np.ndarray]:
    """A_log = log(A), A ~ U(0, 16), and dt_bias = softplus^-1(dt), dt ~ logU(1e-3, 0.1) floored at 1e-4
    (flash-linear-attention's GatedDeltaProduct initialisation)."""
    a_log = np.log(rng.uniform(0.0, 16.0, heads))
    dt = np.maximum(np.exp(rng.uniform(size=heads) * (np.log(0.1) - np.log(1e-3)) + np.log(1e-3)), 1e-4)
    return a_log, dt + np.log(-np.expm1(-dt))


def initial_table(config, seed: int = 0, *, init_std: float | None = None) -> dict[str, np.ndarray]:
    """Initial weights of the module built from ``config``, float32, drawn with numpy from ``seed``:
    load them with either frontend's ``load_state_table`` and the torch and JAX models start equal.

    The distributions are the layers' own: linear weights and biases U(-1/sqrt(in), 1/sqrt(in)) (as
    ``torch.nn.Linear``), conv taps U(-1/sqrt(W), 1/sqrt(W)), norms one, A_log and dt_bias as FLA; a
    decoder (and any ``init_std``) draws its projections, embeddings and head from N(0, init_std),
    init_std = 0.02 by default, as ``HybridDecoder`` does.
    """
    if init_std is None and isinstance(config, DecoderConfig):
        init_std = 0.02
    rng = np.random.default_rng(seed)
    shapes = parameter_shapes(config)
    table: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        owner, _, leaf = name.rpartition(".")
        if leaf == "A_log":
            table[name], table[f"{owner}.dt_bias" if owner else "dt_bias"] = _decay_init(rng, shape[0])
        elif leaf == "dt_bias":
            continue  # drawn with A_log
        elif owner.endswith("norm"):
            table[name] = np.ones(shape)
        elif owner.endswith("conv1d"):
            bound = 1.0 / np.sqrt(shapes[f"{owner}.weight"][-1])
            table[name] = rng.uniform(-bound, bound, shape)
        elif init_std is not None and leaf == "weight" and (owner.endswith("proj")
                                                            or owner in ("embeddings", "lm_head")):
            table[name] = rng.normal(0.0, init_std, shape)
        elif owner == "embeddings":
            table[name] = rng.normal(0.0, 1.0, shape)
        else:  # a linear layer's weight [out, in] or bias [out]
            bound = 1.0 / np.sqrt(shapes[f"{owner}.weight"][1])
            table[name] = rng.uniform(-bound, bound, shape)
    return {name: table[name].astype(np.float32) for name in shapes}


__all__ = ["checked_table", "flat_table", "initial_table", "to_numpy"]
