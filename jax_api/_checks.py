"""Value checks of the JAX ops: run eagerly, on concrete arrays only (``check_inputs``).

Under ``jax.jit`` / ``shard_map`` the inputs are tracers with no values, so the ops check what is
static there (shapes, dtypes, limits, concrete ids) and *contain* non-finite values instead of
reporting them (``cp_linear.validation``: outputs that depend on a NaN/Inf are NaN, the rest exact).
Called eagerly with concrete arrays, ``check_inputs=True`` computes every flag in one small jitted
reduction and reads them in one host transfer, then raises ValueError like the torch frontend.
To report non-finite values inside ``jit`` use ``jax.experimental.checkify`` or ``jax_debug_nans``
around your step; the ops do not add them (they would cost every traced call, and
``checkify`` changes the function's signature).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cp_linear.validation import describe_failed


def is_concrete(*arrays) -> bool:
    """True when no argument is a tracer (so its values can be read now)."""
    return not any(isinstance(x, jax.core.Tracer) for x in arrays if x is not None)


@functools.partial(jax.jit, static_argnums=0)
def _flags(flag_fn, *arrays):
    return jnp.stack([jnp.asarray(f, bool).reshape(()) for f in flag_fn(*arrays)])


def raise_failed_value_checks(checks, flag_fn, *arrays, what: str) -> None:
    """Evaluate ``flag_fn(*arrays)`` (a list of 0-d booleans, True = failed, in ``checks`` order) and
    raise ValueError naming every failed check. One jitted reduction, one host read."""
    flags = _flags(flag_fn, *arrays)
    if isinstance(flags, jax.core.Tracer):  # concrete arrays closed over inside someone's jit: no value yet
        return
    failed = np.asarray(flags).tolist()
    message = describe_failed(checks, failed)
    if message:
        raise ValueError(f"{what}: {message}")


__all__ = ["is_concrete", "raise_failed_value_checks"]
