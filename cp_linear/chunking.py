"""The chunk layout of Gated DeltaProduct, one for every backend: built from ``cu_seqlens``, generic
over numpy / torch / jax arrays (``array_api_compat``), with static shapes (usable under ``jax.jit``
and without a host read in torch).

Vocabulary
  step      GDP over T tokens is a gated delta rule over S = T * n_h steps: token t owns steps
            t*n_h .. t*n_h + n_h - 1 (its gate sits on the first, q is read on the last; docs/design.md §2
            in docs/design.md). Steps are numbered along the packed row.
  sequence  tokens ``[cu_seqlens[n], cu_seqlens[n + 1])``; an *empty* sequence (equal bounds) owns no
            step and no chunk, and its final state is its initial state.
  chunk     at most ``chunk_size`` (C) consecutive steps of ONE sequence. Every nonempty sequence
            starts a new chunk, so a sequence's last chunk may be short.
  slot      a chunk-major position ``chunk * C + i``; slot i of chunk c holds step
            ``chunk_start[c] + i`` when ``i < chunk_len[c]``, else padding (an identity step:
            q = k = v = 0, beta = 0, g = 0).

Arrays of ``ChunkLayout`` (all int32):
  chunk_offsets  [N + 1]   first chunk of each sequence; ``chunk_offsets[N]`` = chunks in use
  chunk_start    [C_max]   first step of every chunk (slots past the last chunk: start of nothing)
  chunk_len      [C_max]   steps in the chunk (0 for slots past the last chunk)
  chunk_seq      [C_max]   sequence of the chunk (the last sequence for slots past the last chunk)
C_max = ``max_chunks(S, N, C)`` is a static bound that needs no value of ``cu_seqlens``:
sum_n ceil(s_n / C) <= sum_n (s_n + C - 1) / C = (S + (C - 1) N) / C, and no chunk is empty.

Worked example: cu_seqlens = [0, 3, 3, 70] tokens, n_h = 1, C = 64 (S = 70, N = 3)::

    sequence 0: steps 0..2    -> chunk 0 (start 0,  len 3)
    sequence 1: empty          -> no chunk
    sequence 2: steps 3..69   -> chunk 1 (start 3,  len 64), chunk 2 (start 67, len 3)
    chunk_offsets [0, 1, 1, 3]; C_max = (70 + 63 * 3) // 64 = 4, so chunk 3 is an unused slot (len 0)

The arrays are what a kernel host path needs (per-chunk first step, length and sequence; per-sequence
chunk offsets; int32; a static slot count from T and N), built without a host read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import array_api_compat

CHUNK_SIZE = 64  # interleaved steps per chunk, for every backend and kernel

Array = Any  # numpy.ndarray | torch.Tensor | jax.Array


def max_chunks(total_steps: int, num_sequences: int, chunk_size: int = CHUNK_SIZE) -> int:
    """Static upper bound on the chunks of ``num_sequences`` sequences over ``total_steps`` steps."""
    for name, value in (("total_steps", total_steps), ("num_sequences", num_sequences)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0; received {value!r}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; received {chunk_size!r}")
    return min(total_steps, (total_steps + (chunk_size - 1) * num_sequences) // chunk_size)


@dataclass(frozen=True)
class ChunkLayout:
    """Where every chunk of a packed row of steps sits (see the module docstring); int32 arrays."""

    chunk_offsets: Array
    chunk_start: Array
    chunk_len: Array
    chunk_seq: Array
    total_steps: int
    chunk_size: int

    @property
    def num_sequences(self) -> int:
        return int(self.chunk_offsets.shape[0]) - 1

    @property
    def num_slots(self) -> int:
        """C_max: the static number of chunk slots."""
        return int(self.chunk_start.shape[0])

    def _xp(self):
        return array_api_compat.array_namespace(self.chunk_start)

    def starts_sequence(self) -> Array:
        """bool [C_max]: the chunk is the first chunk of its (nonempty) sequence."""
        xp = self._xp()
        index = xp.arange(self.num_slots, dtype=xp.int32, device=array_api_compat.device(self.chunk_start))
        first = xp.take(self.chunk_offsets, self.chunk_seq)
        return (self.chunk_len > 0) & (index == first)

    def sequence_nonempty(self) -> Array:
        """bool [N]: the sequence owns at least one step."""
        return self.chunk_offsets[1:] > self.chunk_offsets[:-1]

    def first_chunk(self) -> Array:
        """int32 [N]: the first chunk of each sequence (the next sequence's for an empty one)."""
        return self.chunk_offsets[:-1]

    def last_chunk(self) -> Array:
        """int32 [N]: the last chunk of each nonempty sequence (clamped to 0 for empty ones)."""
        xp = self._xp()
        return xp.maximum(self.chunk_offsets[1:] - 1, xp.zeros_like(self.chunk_offsets[1:]))

    def slot_source(self) -> Array:
        """int32 [C_max * C]: the step each slot holds, or ``total_steps`` for padding.

        Gathering ``concat([steps, zero_row])`` with it lays a [S, ...] array out chunk-major.
        """
        xp = self._xp()
        device = array_api_compat.device(self.chunk_start)
        offset = xp.arange(self.chunk_size, dtype=xp.int32, device=device)
        step = self.chunk_start[:, None] + offset[None, :]
        inside = offset[None, :] < self.chunk_len[:, None]
        padding = xp.full(step.shape, self.total_steps, dtype=xp.int32, device=device)
        return xp.reshape(xp.where(inside, step, padding), (-1,))

    def step_slot(self, step_bounds: Array) -> Array:
        """int32 [S]: the slot of every step; ``step_bounds`` are the sequences' step offsets [N + 1]."""
        xp = self._xp()
        device = array_api_compat.device(self.chunk_start)
        step = xp.arange(self.total_steps, dtype=xp.int32, device=device)
        sequence = _sequence_of(xp, step_bounds, step)
        within = step - xp.take(step_bounds, sequence)
        chunk = xp.take(self.chunk_offsets, sequence) + within // self.chunk_size
        return chunk * self.chunk_size + within % self.chunk_size


def bounds_after_first(bounds: Array, values: Array, last: int | None = None) -> Array:
    """``searchsorted(bounds[1:], values, side="right")`` for sorted ``bounds``, without slicing them:
    Inductor (torch 2.11) cannot lower a searchsorted over a slice view. Equal by construction: the
    first bound is counted when it is <= the value (then subtracted), and when it is not, no later
    bound is <= the value either (clipped at 0). ``last``: also clipped to at most ``last`` (same clip)."""
    xp = array_api_compat.array_namespace(bounds)
    return xp.clip(_searchsorted(xp, bounds, values, side="right") - 1, 0, last)


def _searchsorted(xp, sorted_values: Array, values: Array, *, side: str) -> Array:
    """``xp.searchsorted``; in JAX unrolled (its default method is a while loop: on a GPU, launches per
    halving step and a loop the program cannot fuse; unrolled, XLA fuses the halvings into one pass)."""
    if array_api_compat.is_jax_namespace(xp):
        return xp.searchsorted(sorted_values, values, side=side, method="scan_unrolled")
    return xp.searchsorted(sorted_values, values, side=side)


def _sequence_of(xp, bounds: Array, positions: Array) -> Array:
    """Index n of the (nonempty) sequence ``bounds[n] <= position < bounds[n + 1]`` of every position."""
    return xp.astype(bounds_after_first(bounds, positions, last=bounds.shape[0] - 2), xp.int32)


def chunk_layout(cu_seqlens: Array, *, total_steps: int, num_householder: int = 1,
                 chunk_size: int = CHUNK_SIZE) -> tuple[ChunkLayout, Array]:
    """The layout of a packed row from token offsets ``cu_seqlens`` int [N + 1] (values may be traced).

    ``total_steps`` (S = T * n_h) must be static. Returns ``(layout, step_bounds)`` with
    ``step_bounds = cu_seqlens * n_h`` int32 [N + 1]. ``cu_seqlens`` must be nondecreasing from 0
    to T (the frontends check concrete values); empty sequences are allowed.
    """
    xp = array_api_compat.array_namespace(cu_seqlens)
    device = array_api_compat.device(cu_seqlens)
    count = int(cu_seqlens.shape[0]) - 1
    if count < 1:
        raise ValueError(f"cu_seqlens must have N + 1 >= 2 entries; received shape {tuple(cu_seqlens.shape)}")
    slots = max_chunks(total_steps, count, chunk_size)
    bounds = xp.astype(cu_seqlens, xp.int32) * num_householder
    lengths = bounds[1:] - bounds[:-1]
    chunks = (lengths + (chunk_size - 1)) // chunk_size
    zero = xp.zeros((1,), dtype=xp.int32, device=device)
    offsets = xp.concat([zero, xp.astype(xp.cumulative_sum(chunks), xp.int32)])
    slot = xp.arange(slots, dtype=xp.int32, device=device)
    sequence = _sequence_of(xp, offsets, slot)
    start = xp.take(bounds, sequence) + chunk_size * (slot - xp.take(offsets, sequence))
    remaining = xp.take(bounds[1:], sequence) - start
    length = xp.clip(remaining, 0, chunk_size) if slots else remaining
    layout = ChunkLayout(chunk_offsets=offsets, chunk_start=xp.astype(start, xp.int32),
                         chunk_len=xp.astype(length, xp.int32), chunk_seq=sequence, total_steps=int(total_steps),
                         chunk_size=int(chunk_size))
    return layout, bounds


def cu_seqlens_from_seq_idx(seq_idx: Array, max_sequences: int) -> Array:
    """int32 [max_sequences + 1] token offsets of the runs of equal ids in ``seq_idx`` [T] (nondecreasing
    ids; values may be traced). Runs past the last are empty, so the shape is static: the bound must
    be at least the number of runs (the caller guarantees it, e.g. ``max_sequences = T``)."""
    xp = array_api_compat.array_namespace(seq_idx)
    device = array_api_compat.device(seq_idx)
    tokens = int(seq_idx.shape[0])
    changes = xp.astype(seq_idx[1:] != seq_idx[:-1], xp.int32)
    run = xp.concat([xp.zeros((1,), dtype=xp.int32, device=device), xp.cumulative_sum(changes)])
    wanted = xp.arange(max_sequences + 1, dtype=run.dtype, device=device)
    cu = xp.astype(_searchsorted(xp, run, wanted, side="left"), xp.int32)
    return xp.minimum(cu, xp.full(cu.shape, tokens, dtype=xp.int32, device=device))


def max_shard_sequences(seq_idx, cp_size: int, *, floor: int = 1) -> int:
    """Static bound on the sequences one shard holds, from concrete host ids [T] (nondecreasing):
    the most any of the ``cp_size`` shards holds, at least ``floor``, rounded up to a power of two
    (so that packings with similar counts share one compiled program) and capped at L."""
    import numpy as np

    ids = np.asarray(seq_idx).reshape(-1)
    local_len = ids.shape[0] // cp_size
    shards = ids[: local_len * cp_size].reshape(cp_size, local_len)
    most = max(int(np.max(1 + np.count_nonzero(shards[:, 1:] != shards[:, :-1], axis=1))), int(floor), 1)
    return min(local_len, 1 << (most - 1).bit_length())


__all__ = ["CHUNK_SIZE", "ChunkLayout", "bounds_after_first", "chunk_layout", "cu_seqlens_from_seq_idx", "max_chunks",
           "max_shard_sequences"]
