"""Host description of a packed batch, shared by the torch and JAX layers (numpy only).

Glossary
  doc_ids    int [T], 0 = padding: the block-diagonal attention mask (docs/design.md §3)
  seq_idx    int [T], nondecreasing: one id per *run* of equal doc ids; GDP sequences
             (docs/design.md §2). A padding run is a sequence of its own, so no state leaks across it.
  position   int [T]: global index minus the start of its run. RoPE angle of the token, and how far
             back the causal conv may reach (tap s reads token t - s only when s <= position[t])
  unpacked   no ids given: every batch row is one sequence of T tokens (position = index)

Worked example: doc_ids [1 1 1 0 2 2 | 2 2 3 3 3 3], cp_size = 2, L = 6::

    seq_idx    0 0 0 1 2 2 | 2 2 3 3 3 3
    position   0 1 2 0 0 1 | 2 3 0 1 2 3
    rank 1's first tokens continue document 2: their conv taps and RoPE positions reach back
    over the rank boundary; document 3 starts inside the shard and sees nothing before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cp_linear._host import to_host_int_array
from cp_linear.plan import (
    PackedSequenceCPMetadata,
    build_packed_sequence_cp_metadata,
    cu_seqlens_to_seq_idx,
    ids_fingerprint,
    validate_doc_ids,
    validate_global_seq_idx,
)


def _run_starts(ids: np.ndarray) -> np.ndarray:
    """bool [T]: True where a run of equal ids begins."""
    return np.concatenate([[True], ids[1:] != ids[:-1]])


def _position_in_run(ids: np.ndarray) -> np.ndarray:
    index = np.arange(ids.shape[0])
    return index - np.maximum.accumulate(np.where(_run_starts(ids), index, 0))


@dataclass(frozen=True)
class PackedLayout:
    """doc_ids, seq_idx, position: int64 [T] (see the module glossary); ``packed`` False for rows."""

    doc_ids: np.ndarray
    seq_idx: np.ndarray
    position: np.ndarray
    packed: bool = True

    def __post_init__(self):
        # Tamper-evident: seq_idx and position are functions of doc_ids; an edited layout (e.g. through
        # dataclasses.replace) records why in ``error`` and the layers raise it on every rank together.
        error = None
        try:
            ids = np.asarray(self.doc_ids)
            if ids.ndim != 1 or any(np.shape(x) != ids.shape for x in (self.seq_idx, self.position)):
                raise ValueError(f"doc_ids, seq_idx and position must share one shape [T]; received "
                                 f"{np.shape(ids)}, {np.shape(self.seq_idx)}, {np.shape(self.position)}")
            if not np.array_equal(self.seq_idx, np.cumsum(_run_starts(ids)) - 1):
                raise ValueError("PackedLayout.seq_idx does not match its doc_ids (edited after it was built?)")
            if not np.array_equal(self.position, _position_in_run(ids)):
                raise ValueError("PackedLayout.position does not match its doc_ids (edited after it was built?)")
            for name in ("doc_ids", "seq_idx", "position"):
                frozen = np.array(getattr(self, name), dtype=np.int64, copy=True)
                frozen.flags.writeable = False
                object.__setattr__(self, name, frozen)
        except ValueError as err:
            error = str(err)
        object.__setattr__(self, "_error", error)
        object.__setattr__(self, "_ids_fingerprint", ids_fingerprint(self.doc_ids))

    @property
    def error(self) -> str | None:
        """Why the layout is inconsistent (fields edited), or None."""
        return self._error

    @property
    def total_len(self) -> int:
        return int(self.doc_ids.shape[0])

    @classmethod
    def from_doc_ids(cls, doc_ids) -> "PackedLayout":
        """int [T] or [1, T]; 0 = padding anywhere; each document one contiguous run."""
        ids = validate_doc_ids(doc_ids, 1).copy()
        seq_idx = np.cumsum(_run_starts(ids)) - 1
        return cls(ids, seq_idx, _position_in_run(ids))

    @classmethod
    def from_seq_idx(cls, seq_idx) -> "PackedLayout":
        """int [1, T] (or [T]) nondecreasing sequence ids, every token real (no padding)."""
        ids = to_host_int_array(seq_idx, "seq_idx")
        ids = validate_global_seq_idx(ids.reshape(1, -1) if ids.ndim == 1 else ids, 1)
        runs = np.cumsum(_run_starts(ids)) - 1
        return cls(runs + 1, runs, _position_in_run(ids))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens) -> "PackedLayout":
        """int [N + 1] cumulative sequence lengths from 0 to T."""
        return cls.from_seq_idx(cu_seqlens_to_seq_idx(cu_seqlens))

    @classmethod
    def unpacked(cls, total_len: int) -> "PackedLayout":
        """Every batch row is one sequence of ``total_len`` tokens."""
        if not isinstance(total_len, (int, np.integer)) or total_len < 1:
            raise ValueError(f"total_len must be a positive int; received {total_len!r}")
        return cls(np.ones(total_len, np.int64), np.zeros(total_len, np.int64), np.arange(total_len), packed=False)

    def cu_seqlens(self) -> np.ndarray:
        """int32 [N + 1]: the boundaries of the GDP sequences (runs)."""
        starts = np.nonzero(_run_starts(self.seq_idx))[0]
        return np.concatenate([starts, [self.total_len]]).astype(np.int32)

    def check_cp_size(self, cp_size: int) -> None:
        if self.total_len % cp_size:
            raise ValueError(f"T = {self.total_len} must be a multiple of cp_size = {cp_size}")

    def local(self, values: np.ndarray, cp_rank: int, cp_size: int) -> np.ndarray:
        """The shard of a per-token array owned by ``cp_rank``."""
        self.check_cp_size(cp_size)
        local_len = self.total_len // cp_size
        return values[cp_rank * local_len:(cp_rank + 1) * local_len]

    def gdp_metadata(self, cp_rank: int, cp_size: int) -> PackedSequenceCPMetadata | None:
        """CP metadata of the GDP sequences for ``cp_rank``; None when unpacked (rows span all ranks)."""
        self.check_cp_size(cp_size)
        if not self.packed:
            return None
        return build_packed_sequence_cp_metadata(self.seq_idx.reshape(1, -1), cp_rank, cp_size)

    def fingerprint(self) -> tuple[int, int]:
        """Two ints that differ when the layouts differ (for cross-rank agreement)."""
        return self._ids_fingerprint, int(self.packed) * self.total_len


def layout_from_ids(*, doc_ids=None, seq_idx=None, cu_seqlens=None, total_len: int) -> PackedLayout:
    """At most one of doc_ids / seq_idx / cu_seqlens; none means unpacked rows of ``total_len``."""
    given = [name for name, value in (("doc_ids", doc_ids), ("seq_idx", seq_idx), ("cu_seqlens", cu_seqlens))
             if value is not None]
    if len(given) > 1:
        raise ValueError(f"pass at most one of doc_ids, seq_idx, cu_seqlens; received {given}")
    if doc_ids is not None:
        layout = PackedLayout.from_doc_ids(doc_ids)
    elif seq_idx is not None:
        layout = PackedLayout.from_seq_idx(seq_idx)
    elif cu_seqlens is not None:
        layout = PackedLayout.from_cu_seqlens(cu_seqlens)
    else:
        return PackedLayout.unpacked(total_len)
    if layout.total_len != total_len:
        raise ValueError(f"the {given[0]} describe T = {layout.total_len} tokens; expected T = {total_len} "
                         "(local length x cp_size; under CP pass the *global* ids, replicated on every rank)")
    return layout


__all__ = ["PackedLayout", "layout_from_ids"]
