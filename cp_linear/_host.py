"""Turn numpy / torch / jax arrays into host numpy arrays for plan building (no framework import)."""

from __future__ import annotations

import numpy as np


def to_host_array(x, name: str) -> np.ndarray:
    """Copy ``x`` (numpy, torch or jax, any device) to a host numpy array.

    Plans are host integers; a traced JAX value has no concrete ids, so it is rejected
    with a message that says so.
    """
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch
        x = x.detach().cpu()
    try:
        return np.asarray(x)
    except Exception as err:  # jax tracers raise a TracerArrayConversionError here
        raise ValueError(
            f"{name} must be a concrete array (numpy, torch or jax); received {type(x).__name__}, "
            "which has no host value (inside jax.jit use the on-device metadata of jax_api instead)"
        ) from err


def to_host_int_array(x, name: str) -> np.ndarray:
    arr = to_host_array(x, name)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers; received dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)
