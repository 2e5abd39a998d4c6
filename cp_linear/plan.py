"""Context-parallel plans built from replicated ids on the host, with no communication.

Glossary
  T                  global (packed) sequence length; split contiguously over ``cp_size`` ranks
  L                  local length, ``T // cp_size``; rank ``r`` owns tokens ``[r*L, (r+1)*L)``
  sequence / doc     a run of equal ids; GDP uses ``global_seq_idx`` (every token belongs to one),
                     attention uses ``doc_ids`` where 0 marks padding
  fragment           the part of a sequence that lies on one rank
  preceding_rank_start  first rank whose summary feeds this rank's incoming state
  following_rank_stop   one past the last rank whose summary feeds this rank's incoming gradient

Worked example: lengths [5, 4, 7] packed into T = 16, cp_size = 4 (L = 4)::

    token    0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15
    seq id   0 0 0 0 | 0 1 1 1 | 1 2  2  2 |  2  2  2  2
    rank         0   |    1    |     2     |      3
    r0: (start, stop) = (0, 2), local_cu_seqlens [0, 4]
    r1: (0, 3), [0, 1, 4]      its first sequence began on rank 0, its last ends on rank 2
    r2: (1, 4), [0, 1, 4]
    r3: (2, 4), [0, 4]

GDP: incoming state of rank r = summaries of ranks [preceding_rank_start, r) folded in order.
Attention: rank r needs keys/values ``[s_first[r], real_end[r])``; ``back[r] = r*L - s_first[r]``
tokens of them live on earlier ranks.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from cp_linear._host import to_host_int_array

EXCHANGE_MODES = ("allgather", "halo", "a2a")


def _check_cp(cp_rank: int | None, cp_size: int) -> None:
    if not isinstance(cp_size, (int, np.integer)) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int; received {cp_size!r}")
    if cp_rank is not None and (
        not isinstance(cp_rank, (int, np.integer)) or isinstance(cp_rank, bool) or not 0 <= cp_rank < cp_size
    ):
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}); received {cp_rank!r}")


# --------------------------------------------------------------------------- GDP metadata


def ids_fingerprint(ids) -> int:
    """A non-negative 62-bit int that changes when the ids (their length or any value) change.

    Cheap host hash (CRC-32 and Adler-32 of the int64 bytes, ~1 GB/s) that ranks exchange in their
    agreement header to prove they hold the same replicated ids; not cryptographic.
    """
    raw = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1).tobytes()
    return ((zlib.crc32(raw) << 30) ^ zlib.adler32(raw) ^ len(raw)) & ((1 << 62) - 1)


@dataclass(frozen=True)
class PackedSequenceCPMetadata:
    """What one rank needs to run chunkwise CP over a packed batch (host values).

    local_seq_idx         int64 [1, L]: sequence ids of the local shard
    local_cu_seqlens      int32 [n + 1]: 0, local positions where the id changes, L
    preceding_rank_start  rank of the first token of the shard's first sequence
    following_rank_stop   1 + rank of the last token of the shard's last sequence
    cp_rank, cp_size      the rank and world size it was built for (checked by the frontends)
    global_seq_idx        int64 [T]: the replicated ids it was built from (read-only)

    Tamper-evident: construction (including ``dataclasses.replace``) checks every field against
    ``global_seq_idx`` and records the result in ``error`` instead of raising, so that the CP op
    can raise it on every rank at once; the arrays are read-only. ``fingerprint`` is
    ``ids_fingerprint(global_seq_idx)``, which the CP op's agreement compares across ranks.
    """

    local_seq_idx: np.ndarray
    local_cu_seqlens: np.ndarray
    preceding_rank_start: int
    following_rank_stop: int
    cp_rank: int = 0
    cp_size: int = 1
    global_seq_idx: np.ndarray | None = None

    def __post_init__(self):
        error, fingerprint = None, -1
        try:
            if self.global_seq_idx is None:
                raise ValueError("metadata carries no global_seq_idx to be checked against; build it with "
                                 "cp_linear.build_packed_sequence_cp_metadata(global_seq_idx, cp_rank, cp_size)")
            ids = validate_global_seq_idx(np.asarray(self.global_seq_idx).reshape(1, -1), self.cp_size)
            _check_cp(self.cp_rank, self.cp_size)
            fingerprint = ids_fingerprint(ids)
            expected = _packed_fields(ids, self.cp_rank, self.cp_size)
            for name, want in expected.items():
                have = getattr(self, name)
                same = (np.array_equal(np.asarray(have), want) and np.shape(have) == np.shape(want)
                        if isinstance(want, np.ndarray) else have == want)
                if not same:
                    raise ValueError(f"metadata.{name} = {np.asarray(have).tolist()} does not match its global_seq_idx "
                                     f"(expected {np.asarray(want).tolist()} for rank {self.cp_rank} of "
                                     f"{self.cp_size}): the metadata was edited after it was built")
            for name in ("local_seq_idx", "local_cu_seqlens", "global_seq_idx"):
                frozen = np.array(getattr(self, name), copy=True)
                frozen.flags.writeable = False
                object.__setattr__(self, name, frozen)
        except ValueError as err:
            error = str(err)
        object.__setattr__(self, "_error", error)
        object.__setattr__(self, "_fingerprint", fingerprint)

    @property
    def error(self) -> str | None:
        """Why this metadata cannot be trusted (fields edited, no ids), or None."""
        return self._error

    @property
    def fingerprint(self) -> int:
        """``ids_fingerprint(global_seq_idx)`` (-1 when the metadata is invalid)."""
        return self._fingerprint

    @property
    def local_len(self) -> int:
        return int(self.local_seq_idx.shape[-1])

    @property
    def starts_new_sequence(self) -> bool:
        """True when the shard's first token begins a sequence (no incoming state)."""
        return self.preceding_rank_start == self.cp_rank

    @property
    def ends_sequence(self) -> bool:
        """True when the shard's last token ends a sequence (no incoming state-gradient)."""
        return self.following_rank_stop == self.cp_rank + 1


def validate_global_seq_idx(global_seq_idx, cp_size: int) -> np.ndarray:
    """Check ``global_seq_idx`` (int [1, T], nondecreasing, T divisible by cp_size); return [T]."""
    _check_cp(None, cp_size)
    ids = to_host_int_array(global_seq_idx, "global_seq_idx")
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"global_seq_idx must have shape [1, T]; received shape {tuple(ids.shape)}")
    ids = ids[0]
    total = ids.shape[0]
    if total == 0 or total % cp_size != 0:
        raise ValueError(f"T = {total} must be a positive multiple of cp_size = {cp_size}")
    decreasing = np.nonzero(np.diff(ids) < 0)[0]
    if decreasing.size:
        at = int(decreasing[0])
        raise ValueError(
            f"global_seq_idx must be nondecreasing; it drops from {ids[at]} to {ids[at + 1]} at index {at + 1}"
        )
    return ids


def _packed_fields(ids: np.ndarray, cp_rank: int, cp_size: int) -> dict:
    """The derived fields of ``PackedSequenceCPMetadata`` from validated ids [T]."""
    local_len = ids.shape[0] // cp_size
    shard_start = cp_rank * local_len
    local = ids[shard_start : shard_start + local_len]
    changes = np.nonzero(np.diff(local) != 0)[0] + 1
    cu = np.concatenate([[0], changes, [local_len]]).astype(np.int32)
    # ids are nondecreasing, so each sequence is one run: searchsorted finds its ends.
    first_index = int(np.searchsorted(ids, local[0], side="left"))
    last_index = int(np.searchsorted(ids, local[-1], side="right")) - 1
    return dict(local_seq_idx=local.reshape(1, local_len), local_cu_seqlens=cu,
                preceding_rank_start=first_index // local_len, following_rank_stop=last_index // local_len + 1)


def build_packed_sequence_cp_metadata(global_seq_idx, cp_rank: int, cp_size: int) -> PackedSequenceCPMetadata:
    """Metadata of rank ``cp_rank`` for a packed batch split over ``cp_size`` ranks (DESIGN.md §2)."""
    _check_cp(cp_rank, cp_size)
    ids = validate_global_seq_idx(global_seq_idx, cp_size)
    return PackedSequenceCPMetadata(**_packed_fields(ids, cp_rank, cp_size), cp_rank=int(cp_rank),
                                    cp_size=int(cp_size), global_seq_idx=ids)


def cu_seqlens_to_seq_idx(cu_seqlens) -> np.ndarray:
    """int [N + 1] cumulative lengths -> int64 [1, T] sequence ids 0..N-1."""
    cu = to_host_int_array(cu_seqlens, "cu_seqlens")
    if cu.ndim != 1 or cu.shape[0] < 2 or cu[0] != 0 or np.any(np.diff(cu) <= 0):
        raise ValueError(f"cu_seqlens must be [0, ...] strictly increasing with ≥ 2 entries; received {cu.tolist()}")
    return np.repeat(np.arange(cu.shape[0] - 1), np.diff(cu)).reshape(1, -1)


# --------------------------------------------------------------------------- block-diagonal attention


@dataclass(frozen=True)
class BlockDiagPlan:
    """Which keys/values each rank needs for block-diagonal causal attention (host ints).

    Per-rank lists, indexed by rank ``r``:
      s_first[r], real_end[r]  global K/V range ``[s_first, real_end)`` rank r attends to
      back[r]                  ``r*L - s_first[r]``: needed tokens that live on earlier ranks
      recv[r][src]             global range ``(start, stop)`` rank r receives from ``src`` (a2a)
      send[r][dst]             global range ``(start, stop)`` rank r sends to ``dst`` (a2a)
    use_halo  every ``back[r] <= L``: one left-neighbour exchange of ``halo_len`` tokens suffices.
    """

    cp_size: int
    local_len: int
    s_first: tuple[int, ...]
    real_end: tuple[int, ...]
    back: tuple[int, ...]
    recv: tuple[tuple[tuple[int, int], ...], ...]
    send: tuple[tuple[tuple[int, int], ...], ...]
    use_halo: bool

    @property
    def halo_len(self) -> int:
        return max(self.back)

    def needed_len(self, rank: int) -> int:
        return self.real_end[rank] - self.s_first[rank]


def validate_doc_ids(doc_ids, cp_size: int) -> np.ndarray:
    """Check ``doc_ids`` (int [T] or [1, T], 0 = padding, each document one contiguous run)."""
    _check_cp(None, cp_size)
    ids = to_host_int_array(doc_ids, "doc_ids")
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise ValueError(f"doc_ids must have shape [T] (or [1, T]); received shape {tuple(ids.shape)}")
    total = ids.shape[0]
    if total == 0 or total % cp_size != 0:
        raise ValueError(f"T = {total} must be a positive multiple of cp_size = {cp_size}")
    if np.any(ids < 0):
        raise ValueError(f"doc_ids must be ≥ 0 (0 = padding); found {int(ids.min())}")
    run_starts = np.concatenate([[0], np.nonzero(np.diff(ids) != 0)[0] + 1])
    run_ids = ids[run_starts]
    real_runs = run_ids[run_ids > 0]
    unique, counts = np.unique(real_runs, return_counts=True)
    if np.any(counts > 1):
        doc = int(unique[counts > 1][0])
        positions = run_starts[run_ids == doc].tolist()
        raise ValueError(
            f"document id {doc} occupies more than one contiguous run (runs start at {positions}); "
            "each document must be one run of equal ids"
        )
    return ids


def build_blockdiag_plan(doc_ids, cp_size: int) -> BlockDiagPlan:
    """Exchange plan for block-diagonal attention under CP (DESIGN.md §3), identical on every rank."""
    ids = validate_doc_ids(doc_ids, cp_size)
    total = ids.shape[0]
    local_len = total // cp_size
    # start index of the document each token belongs to (padding tokens: their own index).
    run_start_of = np.maximum.accumulate(np.where(np.concatenate([[True], ids[1:] != ids[:-1]]), np.arange(total), 0))
    s_first, real_end = [], []
    for rank in range(cp_size):
        shard_start = rank * local_len
        real = np.nonzero(ids[shard_start : shard_start + local_len] > 0)[0]
        if real.size == 0:
            s_first.append(shard_start)
            real_end.append(shard_start)
            continue
        first_real = shard_start + int(real[0])
        s_first.append(min(shard_start, int(run_start_of[first_real])))
        real_end.append(shard_start + int(real[-1]) + 1)
    back = [rank * local_len - s_first[rank] for rank in range(cp_size)]

    def overlap(rank: int, src: int) -> tuple[int, int]:
        start = max(s_first[rank], src * local_len)
        stop = min(real_end[rank], (src + 1) * local_len)
        return (start, stop) if start < stop else (src * local_len, src * local_len)

    recv = tuple(tuple(overlap(rank, src) for src in range(cp_size)) for rank in range(cp_size))
    send = tuple(tuple(recv[dst][rank] for dst in range(cp_size)) for rank in range(cp_size))
    return BlockDiagPlan(
        cp_size=cp_size,
        local_len=local_len,
        s_first=tuple(s_first),
        real_end=tuple(real_end),
        back=tuple(back),
        recv=recv,
        send=send,
        use_halo=all(b <= local_len for b in back),
    )


def needed_kv_a2a_splits(plan: BlockDiagPlan, rank: int) -> tuple[list[int], list[int], np.ndarray]:
    """Splits for a needed-only all-to-all-v on ``rank``.

    Returns ``(in_splits, out_splits, send_index)``: ``in_splits[dst]`` tokens this rank sends to
    ``dst``; ``out_splits[src]`` tokens it receives from ``src``; ``send_index`` int64 local token
    indices, concatenated in destination order. Pieces received in source order concatenate to
    exactly ``[s_first[rank], real_end[rank])``.
    """
    _check_cp(rank, plan.cp_size)
    shard_start = rank * plan.local_len
    in_splits = [stop - start for start, stop in plan.send[rank]]
    out_splits = [stop - start for start, stop in plan.recv[rank]]
    pieces = [np.arange(start, stop, dtype=np.int64) - shard_start for start, stop in plan.send[rank]]
    send_index = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    return in_splits, out_splits, send_index


def exchange_tokens_received(plan: BlockDiagPlan, mode: str) -> list[int]:
    """Tokens of K/V each rank receives from other ranks in one direction of ``mode``.

    all-gather: every other shard; halo: ``halo_len`` from the left neighbour (rank 0 gets none);
    a2a: only the needed tokens that live elsewhere. The backward pass moves the same amounts.
    """
    if mode not in EXCHANGE_MODES:
        raise ValueError(f"mode must be one of {EXCHANGE_MODES}; received {mode!r}")
    cp, length = plan.cp_size, plan.local_len
    if mode == "allgather":
        return [(cp - 1) * length] * cp
    if mode == "halo":
        if not plan.use_halo:
            raise ValueError(f"halo needs every back ≤ L = {length}; back = {list(plan.back)}")
        return [0] + [plan.halo_len] * (cp - 1)
    return [sum(stop - start for src, (start, stop) in enumerate(plan.recv[rank]) if src != rank) for rank in range(cp)]


def exchange_bytes(
    plan: BlockDiagPlan, mode: str, *, batch: int, kv_heads: int, head_dim: int, itemsize: int
) -> dict[str, int]:
    """Bytes of K and V one forward exchange moves: total over ranks and the busiest rank's share."""
    per_token = 2 * batch * kv_heads * head_dim * itemsize  # K and V travel together
    received = exchange_tokens_received(plan, mode)
    return {"total": sum(received) * per_token, "max_per_rank": max(received) * per_token}
