"""Load-balanced (zig-zag) CP layout: rank r holds chunks r and 2·cp−1−r of 2·cp equal chunks.

Glossary
  chunk          one of ``2·cp`` equal slices of the global packed sequence, ``C = T / (2·cp)`` tokens;
                 chunk c = global tokens ``[c·C, (c+1)·C)``
  virtual shard  a chunk seen as one shard of a contiguous ``2·cp``-way split: the contiguous layout's
                 GDP metadata and attention plan, built for ``cp_size = 2·cp``, describe it as they are
  local order    rank r's ``L = 2·C`` tokens: chunk r, then chunk ``2·cp−1−r``
  layout         "contiguous" (rank r holds ``[r·L, (r+1)·L)``, the default) or "zigzag"

Worked example, T = 16, cp = 2 (C = 4)::

    global   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15
    chunk        0   |    1    |     2     |      3
    rank         0   |    1    |     1     |      0
    rank 0 local: 0 1 2 3 12 13 14 15      rank 1 local: 4 5 6 7 8 9 10 11

Why: a causal query's attention work grows with its position in its document, so on long documents
the contiguous layout's last rank does the most; pairing an early chunk with a late one evens the
work out (``attention_block_work`` counts it). GDP does not care about balance but must follow the
sequence order: each rank prepares one summary per chunk, every rank gathers all ``2·cp`` of them,
and chunk c's incoming state is the fold of chunks ``[preceding_rank_start, c)`` of its virtual
metadata, in sequence order (a rank's two chunks are not adjacent, so the fold crosses other ranks'
chunks in between). The backward folds ``[gamma | M^T]`` the same way, descending.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cp_linear.plan import (
    PackedSequenceCPMetadata,
    _check_cp,
    build_packed_sequence_cp_metadata,
    validate_doc_ids,
    validate_global_seq_idx,
)

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; received {layout!r}")
    return layout


def zigzag_gdp_option_error(summary_exchange: str, with_states: bool, check_inputs: bool) -> str | None:
    """Why the zig-zag GDP op cannot run these options (replicated flags: the same on every rank)."""
    if summary_exchange == "scan":
        return "layout='zigzag' exchanges its summaries by all-gather; summary_exchange='scan' is not supported"
    if with_states:
        return "layout='zigzag' does not support initial_state / output_final_state yet"
    if not check_inputs:
        return ("layout='zigzag' needs check_inputs=True: containment of non-finite inputs (check_inputs=False) "
                "is implemented for the contiguous layout only")
    return None


def zigzag_attention_mode_error(mode: str) -> str | None:
    """Why zig-zag attention cannot run exchange ``mode``: its chunks' key ranges are not one suffix of a
    left neighbour, so only the all-gather serves them ("auto" resolves to it)."""
    if mode in ("auto", "allgather"):
        return None
    return (f"layout='zigzag' exchanges K/V by all-gather; mode={mode!r} is not supported "
            "(use 'auto' or 'allgather')")


def virtual_shard_count(cp_size: int, layout: str) -> int:
    """Shards of the contiguous split the layout's chunks form: ``cp`` (contiguous) or ``2·cp``."""
    return cp_size * (2 if check_layout(layout) == "zigzag" else 1)


def rank_chunks(rank: int, cp_size: int, layout: str) -> tuple[int, ...]:
    """The virtual shards rank ``rank`` holds, in local order: ``(rank,)`` or ``(rank, 2·cp−1−rank)``."""
    _check_cp(rank, cp_size)
    if check_layout(layout) == "contiguous":
        return (rank,)
    return (rank, 2 * cp_size - 1 - rank)


def chunk_length(total_len: int, cp_size: int, layout: str) -> int:
    """Tokens per virtual shard, ``T / cp`` or ``T / (2·cp)``; ValueError naming the layout's divisibility rule."""
    shards = virtual_shard_count(cp_size, layout)
    if not isinstance(total_len, (int, np.integer)) or total_len <= 0 or total_len % shards:
        raise ValueError(f"T = {total_len} must be a positive multiple of {shards} (the {layout} layout over "
                         f"cp_size = {cp_size} cuts it into {shards} equal chunks)")
    return int(total_len) // shards


def local_positions(total_len: int, cp_size: int, rank: int, layout: str = "contiguous") -> np.ndarray:
    """int64 [L]: the global position of each of ``rank``'s local tokens."""
    chunk = chunk_length(total_len, cp_size, layout)
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in rank_chunks(rank, cp_size, layout)])


def layout_permutation(total_len: int, cp_size: int, layout: str = "contiguous") -> np.ndarray:
    """int64 [T]: row j of the rank-ordered concatenation of the local shards is global token
    ``perm[j]``. So ``x_local_concat = x_global[perm]`` and ``x_global = x_local_concat[inverse(perm)]``;
    rank r's shard is ``x_global[perm[r·L:(r+1)·L]]``. The identity for "contiguous"."""
    return np.concatenate([local_positions(total_len, cp_size, rank, layout) for rank in range(cp_size)])


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """int64 [T]: ``inverse[perm[j]] = j`` (where global token i sits in the concatenated shards)."""
    perm = np.asarray(perm, dtype=np.int64)
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(perm.shape[0])
    return inverse


def gathered_chunk_order(cp_size: int, layout: str) -> np.ndarray:
    """int64 [virtual shards]: entry c is where chunk (virtual shard) c sits in a rank-major gathered
    stack ``[cp · chunks_per_rank]`` (rank r's per-chunk items in local order): the index that puts
    gathered per-chunk items (GDP summaries, the conv's chunk tails) in sequence order, so that the
    contiguous layout's slices apply to them."""
    per_rank = virtual_shard_count(cp_size, layout) // cp_size
    order = np.empty(cp_size * per_rank, np.int64)
    for rank in range(cp_size):
        for slot, chunk in enumerate(rank_chunks(rank, cp_size, layout)):
            order[chunk] = rank * per_rank + slot
    return order


# --------------------------------------------------------------------------- GDP metadata


@dataclass(frozen=True)
class ZigzagCPMetadata:
    """What one rank needs to run chunkwise CP in the zig-zag layout (host values).

    shards     per local chunk, in local order, the ``PackedSequenceCPMetadata`` of that chunk as
               shard ``chunk`` of a contiguous ``2·cp``-way split (its rank range counts *chunks*)
    cp_rank, cp_size   the rank and the real world size it was built for

    Tamper-evident like ``PackedSequenceCPMetadata``: each shard checks itself against its ids, and
    the shards must be this rank's chunks of the same ids; ``error`` says why not.
    """

    shards: tuple[PackedSequenceCPMetadata, ...]
    cp_rank: int
    cp_size: int

    def __post_init__(self):
        error = None
        try:
            _check_cp(self.cp_rank, self.cp_size)
            chunks = rank_chunks(self.cp_rank, self.cp_size, "zigzag")
            if (not isinstance(self.shards, tuple) or len(self.shards) != 2
                    or not all(isinstance(s, PackedSequenceCPMetadata) for s in self.shards)):
                raise ValueError("ZigzagCPMetadata.shards must be a pair of PackedSequenceCPMetadata; build it with "
                                 "cp_linear.zigzag.build_zigzag_cp_metadata(global_seq_idx, cp_rank, cp_size)")
            error = next((s.error for s in self.shards if s.error), None)
            placed = tuple((s.cp_rank, s.cp_size) for s in self.shards)
            if error is None and placed != tuple((c, 2 * self.cp_size) for c in chunks):
                error = (f"ZigzagCPMetadata.shards were built for chunks {placed}; rank {self.cp_rank} of "
                         f"{self.cp_size} holds chunks {[(c, 2 * self.cp_size) for c in chunks]}")
            if error is None and self.shards[0].fingerprint != self.shards[1].fingerprint:
                error = "ZigzagCPMetadata.shards were built from different global_seq_idx"
        except ValueError as err:
            error = str(err)
        object.__setattr__(self, "_error", error)

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def fingerprint(self) -> int:
        return -1 if self._error else self.shards[0].fingerprint

    @property
    def local_len(self) -> int:
        return sum(shard.local_len for shard in self.shards)

    @property
    def global_seq_idx(self) -> np.ndarray:
        return self.shards[0].global_seq_idx


def build_zigzag_cp_metadata(global_seq_idx, cp_rank: int, cp_size: int) -> ZigzagCPMetadata:
    """``ZigzagCPMetadata`` of ``cp_rank`` from the replicated ids int [1, T] in *global* (sequence)
    order, T divisible by ``2·cp_size``."""
    _check_cp(cp_rank, cp_size)
    ids = validate_global_seq_idx(global_seq_idx, cp_size).reshape(1, -1)
    chunk_length(ids.shape[1], cp_size, "zigzag")  # names the zig-zag's own divisibility rule
    shards = tuple(build_packed_sequence_cp_metadata(ids, chunk, 2 * cp_size)
                   for chunk in rank_chunks(cp_rank, cp_size, "zigzag"))
    return ZigzagCPMetadata(shards, cp_rank, cp_size)


def virtual_rank_ranges(metadata, cp_rank: int, cp_size: int, layout: str) -> tuple[tuple[int, int, int], ...]:
    """Per local virtual shard ``(chunk, preceding_start, following_stop)`` in chunk units: the shard's
    incoming state folds gathered summaries ``[preceding_start, chunk)``, its outgoing state-gradient
    ``[chunk + 1, following_stop)`` (sequence order). ``metadata``: the layout's metadata, or None when
    every batch row is one sequence spanning all chunks."""
    chunks = rank_chunks(cp_rank, cp_size, layout)
    if metadata is None:
        return tuple((c, 0, virtual_shard_count(cp_size, layout)) for c in chunks)
    shards = metadata.shards if layout == "zigzag" else (metadata,)
    return tuple((c, s.preceding_rank_start, s.following_rank_stop) for c, s in zip(chunks, shards))


# --------------------------------------------------------------------------- attention work


def attention_block_work(doc_ids, cp_size: int, layout: str = "contiguous", *, block_size: int = 128) -> np.ndarray:
    """int64 [cp]: the [block_size x block_size] tiles of the block-diagonal causal mask each rank
    computes (a tile is kept when any of its pairs is allowed), with its query blocks aligned to its
    chunk starts and key blocks to global 0, as a block-sparse kernel runs them. One kept tile costs
    ``4 · block_size² · head_dim`` FLOPs per query head forward (QKᵀ and PV).

    ``doc_ids`` int [T] (0 = padding). A query at global p reads keys ``[doc_start(p), p]``; a query
    block's kept key blocks are the union of those ranges over its real rows, block-aligned.
    """
    ids = validate_doc_ids(doc_ids, virtual_shard_count(cp_size, layout))
    total = ids.shape[0]
    chunk = chunk_length(total, cp_size, layout)
    index = np.arange(total)
    doc_start = np.maximum.accumulate(np.where(np.concatenate([[True], ids[1:] != ids[:-1]]), index, 0))
    work = np.zeros(cp_size, np.int64)
    for rank in range(cp_size):
        for c in rank_chunks(rank, cp_size, layout):
            for lo in range(c * chunk, (c + 1) * chunk, block_size):
                rows = np.arange(lo, min(lo + block_size, (c + 1) * chunk))
                rows = rows[ids[rows] > 0]
                if rows.size == 0:
                    continue
                kept = np.zeros(-(-total // block_size), bool)
                # rows of one document share doc_start: one key range per document segment
                segment_last = np.nonzero(np.concatenate([doc_start[rows][1:] != doc_start[rows][:-1], [True]]))[0]
                for last in rows[segment_last]:
                    kept[doc_start[last] // block_size:last // block_size + 1] = True
                work[rank] += int(kept.sum())
    return work


__all__ = [
    "LAYOUTS",
    "ZigzagCPMetadata",
    "attention_block_work",
    "build_zigzag_cp_metadata",
    "check_layout",
    "chunk_length",
    "inverse_permutation",
    "layout_permutation",
    "local_positions",
    "rank_chunks",
    "gathered_chunk_order",
    "virtual_rank_ranges",
    "virtual_shard_count",
    "zigzag_attention_mode_error",
    "zigzag_gdp_option_error",
]
