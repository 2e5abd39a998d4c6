"""The mesh a global-array entry point runs on (``gdp_chunkwise_context_parallel``, ``blockdiag_attention``,
``cp_apply``), for meshes with Auto or Explicit axes alike.

JAX >= 0.10 gives ``jax.make_mesh`` Explicit axis types: an array placed on such a mesh carries its
sharding in its type, and eager code outside a mesh context (``jax.set_mesh``) can then neither index
it (``ShardingTypeError``) nor differentiate through it. So an entry point

  * inside a mesh context, or on a mesh with Auto axes, runs on the mesh as given (an input of an
    Explicit axis is resharded to the op's layout, as the types require);
  * outside a mesh context, runs an Explicit mesh as the same devices with Auto axes: the results
    are ordinary arrays that index, differentiate and print anywhere.

The calls used (``AxisType``, ``Mesh(..., axis_types=...)``, ``get_abstract_mesh``, ``reshard``)
behave the same on JAX 0.10 and 0.11.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding


def is_explicit(mesh, axis_name: str | None = None) -> bool:
    """``axis_name`` (or any axis, when None) of ``mesh`` is Explicit."""
    types = tuple(getattr(mesh, "axis_types", None) or ())
    if not types:
        return False
    if axis_name is None:
        return AxisType.Explicit in types
    return types[tuple(mesh.axis_names).index(axis_name)] == AxisType.Explicit


def run_mesh(mesh):
    """``mesh`` itself, or its Auto twin when it has Explicit axes and no mesh context is active."""
    if not is_explicit(mesh) or not jax.sharding.get_abstract_mesh().empty:
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def place(x, mesh, spec):
    """``x`` laid out as ``spec`` on ``mesh`` (inside or outside jit): a reshard on Explicit axes, whose
    types must match the op's layout, else a device_put (a sharding constraint under jit)."""
    sharding = NamedSharding(mesh, spec)
    return jax.reshard(x, sharding) if is_explicit(mesh) else jax.device_put(x, sharding)


__all__ = ["is_explicit", "place", "run_mesh"]
