"""The JAX execution of the GDP summary exchange, inside ``jax.shard_map``: all-gather or log-depth scan.

The choice ("all_gather" | "scan" | "auto", ``SCAN_MIN_WORLD``) and the scan's bookkeeping are
framework-neutral (``cp_linear.summary_exchange``: glossary, worked example); torch runs the same
scan over ``batch_isend_irecv`` (``torch_api.gdp.summary_exchange``).

Under JAX the ids are traced data (one compiled program serves every packing), so no rank can skip
a round the way torch's host schedule does. Every round k is one ``jax.lax.ppermute`` with the
static permutation "position i -> i + 2^k" for every i that has a receiver (forward: rank r ->
r + 2^k; backward: r -> r - 2^k), carrying the sender's inclusive fold and whether it is closed;
each receiver decides on device (``scan_round`` on traced flags) whether to fold it, and a rank
that needs nothing masks it away::

    forward, cp = 4, sequences [s0 s0 s0 | s1 ...] (rank 1 starts s1 inside its shard: a stop)
    round 1 (offset 1)   0->1  1->2  2->3        rank 2 folds s1 (closed: s1 starts on rank 1)
    round 2 (offset 2)   0->2  1->3              rank 2 ignores rank 0's fold (its fold is closed)

Cost per direction: ceil(log2 cp) ppermutes of one summary and two ``combine`` per rank per round,
three summaries held (own inclusive fold, exclusive fold, received). The result, one folded summary
[(B,) H, K, V + K] (the identity ``[0 | I]`` where nothing precedes), equals the all-gather path's
fold of the same ranks up to float32 reassociation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cp_linear.summary import combine, identity_summary
from cp_linear.summary_exchange import scan_round


def scan_fold(summary: jax.Array, axis_name: str, *, stop, empty, descending: bool) -> jax.Array:
    """This rank's exclusive fold of ``summary`` [(B,) H, K, V + K] over the mesh axis (call inside shard_map).

    Forward (``descending=False``): the fold of the preceding ranks' ``[E | M]``, ascending; backward:
    of the following ranks' ``[gamma | M^T]``, descending (docs/design.md §2). ``stop`` (bool scalar,
    traced): this rank's summary ignores everything before it in scan order, so folds end here;
    ``empty``: this rank needs no fold (the identity is returned).
    """
    cp_size = jax.lax.axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    position = cp_size - 1 - rank if descending else rank
    heads, key_dim, width = summary.shape[-3:]
    identity = jnp.broadcast_to(identity_summary(heads, key_dim, width - key_dim, like=summary), summary.shape)
    inclusive, exclusive = summary, identity
    inclusive_closed, exclusive_closed = jnp.asarray(stop, bool), jnp.asarray(empty, bool) | (position == 0)
    offset = 1
    while offset < cp_size:
        step = -offset if descending else offset
        perm = [(r, r + step) for r in range(cp_size) if 0 <= r + step < cp_size]
        # ranks without a sender receive zeros; scan_round's has_sender masks them
        received, sender_closed = jax.lax.ppermute((inclusive, inclusive_closed.astype(jnp.int32)), axis_name, perm)
        receives, folds_inclusive, inclusive_closed, exclusive_closed = scan_round(
            inclusive_closed, exclusive_closed, sender_closed.astype(bool), position >= offset)
        exclusive = jnp.where(receives, combine(received, exclusive), exclusive)
        if offset * 2 < cp_size:  # the last round's inclusive folds are never sent
            inclusive = jnp.where(folds_inclusive, combine(received, inclusive), inclusive)
        offset *= 2
    return exclusive


__all__ = ["scan_fold"]
