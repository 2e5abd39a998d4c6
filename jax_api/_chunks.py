"""The chunks a rank holds under a CP layout (``cp_linear.zigzag``), inside ``jax.shard_map``.

The core answers with host ints for a host rank; under shard_map the rank is traced, so the core's
answer for every rank becomes a small constant table indexed by ``lax.axis_index``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cp_linear.zigzag import rank_chunks


def local_chunks(axis_name: str, layout: str) -> jax.Array:
    """int32 [1] (contiguous) or [2] (zig-zag): this rank's virtual shards (chunks) in local order."""
    cp_size = jax.lax.axis_size(axis_name)
    table = np.array([rank_chunks(rank, cp_size, layout) for rank in range(cp_size)], np.int32)
    return jnp.asarray(table)[jax.lax.axis_index(axis_name)]


def local_values(values: jax.Array, axis_name: str, layout: str) -> jax.Array:
    """This rank's entries of a per-token array [T] in global order: its chunks' slices, in local order."""
    chunks = local_chunks(axis_name, layout)
    chunk_len = values.shape[0] // (jax.lax.axis_size(axis_name) * chunks.shape[0])
    return jnp.concatenate([jax.lax.dynamic_slice_in_dim(values, chunk * chunk_len, chunk_len) for chunk in chunks])


__all__ = ["local_chunks", "local_values"]
