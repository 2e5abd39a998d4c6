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

Attention exchange policy (the frontends only turn a routing into their collectives):
  mode       "allgather" | "halo" | "a2a", or "auto" (halo when every back[r] <= L, else a2a);
             ``resolve_exchange_mode`` validates a forced mode before any collective
  routing    ``exchange_routing(plan, mode, rank)``: the key window a rank receives and the a2a
             splits (torch), ``exchange_shape`` + ``ppermute_piece_lens`` / ``ragged_routing``: the
             static sizes and tables of the JAX exchanges
  bytes      ``exchange_tokens_received`` / ``exchange_bytes``: what each rank receives per direction
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import array_api_compat
import numpy as np

from cp_linear._host import to_host_int_array

EXCHANGE_MODES = ("allgather", "halo", "a2a")
MODE_CHOICES = ("auto", *EXCHANGE_MODES)
A2A_IMPLEMENTATIONS = ("exact", "ragged", "ppermute")  # how an a2a runs: "exact" = needed rows only


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
    preceding_rank_start, following_rank_stop = sequence_rank_range(ids, cp_rank, local_len)
    return dict(local_seq_idx=local.reshape(1, local_len), local_cu_seqlens=cu,
                preceding_rank_start=int(preceding_rank_start), following_rank_stop=int(following_rank_stop))


def build_packed_sequence_cp_metadata(global_seq_idx, cp_rank: int, cp_size: int) -> PackedSequenceCPMetadata:
    """Metadata of rank ``cp_rank`` for a packed batch split over ``cp_size`` ranks (docs/design.md §2)."""
    _check_cp(cp_rank, cp_size)
    ids = validate_global_seq_idx(global_seq_idx, cp_size)
    return PackedSequenceCPMetadata(**_packed_fields(ids, cp_rank, cp_size), cp_rank=int(cp_rank),
                                    cp_size=int(cp_size), global_seq_idx=ids)


def sequence_rank_range(ids, rank, local_len: int):
    """``(preceding_rank_start, following_rank_stop)`` of shard ``rank`` from nondecreasing ids [T].

    Array-API generic (numpy, torch, jax; ``rank`` may be traced): ids are nondecreasing, so the
    first and last index of a sequence are the counts of smaller / not larger ids.
    """
    xp = array_api_compat.array_namespace(ids)
    first_id, last_id = ids[rank * local_len], ids[(rank + 1) * local_len - 1]
    first_index = xp.sum(xp.astype(ids < first_id, xp.int32))
    last_index = xp.sum(xp.astype(ids <= last_id, xp.int32)) - 1
    return first_index // local_len, last_index // local_len + 1


def inner_sequence_ranks(ids, rank, local_len: int):
    """``(trailing_start_rank, leading_end_rank)`` of shard ``rank`` from nondecreasing ids [T]: the rank
    where the shard's last sequence starts and the rank where its first sequence ends (the log-depth
    summary scan stops its folds there, ``cp_linear.summary_exchange``). Array-API generic like
    ``sequence_rank_range``, the traced twin of ``SequenceStateRouting.trailing_starts_here`` /
    ``leading_ends_here``."""
    xp = array_api_compat.array_namespace(ids)
    first_id, last_id = ids[rank * local_len], ids[(rank + 1) * local_len - 1]
    trailing_start = xp.sum(xp.astype(ids < last_id, xp.int32))
    leading_end = xp.sum(xp.astype(ids <= first_id, xp.int32)) - 1
    return trailing_start // local_len, leading_end // local_len


@dataclass(frozen=True)
class SequenceStateRouting:
    """Where each global sequence's initial state enters and its final state leaves (host ints).

    Sequence n (a row of ``initial_state`` / ``final_state`` [N, H, K, V]) is the n-th run of equal
    ids of ``global_seq_idx`` in order, or batch row n when every row is one sequence spanning all
    ranks (``rows=True``). Both frontends derive the same routing from the replicated ids::

        ids   0 0 0 0 | 0 1 1 1 | 1 2 2 2 | 2 2 2 2      (lengths [5, 4, 7], cp 4, L 4)
        seq 0: start_rank 0, end_rank 1;  seq 1: 1 -> 2;  seq 2: 2 -> 3
        rank 1: local_rows (0, 1), first row continues (its state comes from rank 0), row 0 ends here

    start_rank[n], end_rank[n]  ranks holding the first and last token of sequence n
    local_rows[r]               global rows of rank r's local sequences, in order
    """

    cp_size: int
    rows: bool
    start_rank: tuple[int, ...]
    end_rank: tuple[int, ...]
    local_rows: tuple[tuple[int, ...], ...]

    @property
    def num_sequences(self) -> int:
        return len(self.start_rank)

    def first_row_continues(self, rank: int) -> bool:
        """The rank's first local sequence began on an earlier rank (its initial state enters there)."""
        return self.start_rank[self.local_rows[rank][0]] < rank

    def ends_here(self, rank: int) -> tuple[bool, ...]:
        """Per local sequence: its last token lies on this rank (its final state is produced here)."""
        return tuple(self.end_rank[row] == rank for row in self.local_rows[rank])

    def trailing_starts_here(self, rank: int) -> bool:
        """The rank's forward summary ignores its incoming state (M = 0 or a fresh start): a prefix
        scan of summaries may stop at this rank."""
        return self.start_rank[self.local_rows[rank][-1]] == rank

    def leading_ends_here(self, rank: int) -> bool:
        """The rank's backward summary ignores its outgoing state-gradient: a suffix scan may stop here."""
        return self.end_rank[self.local_rows[rank][0]] == rank


def sequence_state_routing(global_seq_idx, cp_size: int, *, rows: int | None = None) -> SequenceStateRouting:
    """``SequenceStateRouting`` from the replicated ids int [1, T] (T divisible by cp_size), or, with
    ``global_seq_idx=None``, for ``rows`` batch rows that each span every rank in order."""
    _check_cp(None, cp_size)
    if global_seq_idx is None:
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
            raise ValueError(f"without global_seq_idx, rows must be a positive int; received {rows!r}")
        every = tuple(range(rows))
        return SequenceStateRouting(int(cp_size), True, (0,) * rows, (cp_size - 1,) * rows, (every,) * cp_size)
    ids = validate_global_seq_idx(global_seq_idx, cp_size)
    local_len = ids.shape[0] // cp_size
    run = np.concatenate([[0], np.cumsum(np.diff(ids) != 0)])  # sequence (run) index of every token
    starts = np.concatenate([[0], np.nonzero(np.diff(run))[0] + 1])
    stops = np.concatenate([starts[1:], [ids.shape[0]]])
    local_rows = tuple(tuple(int(x) for x in np.unique(run[r * local_len:(r + 1) * local_len]))
                       for r in range(cp_size))
    return SequenceStateRouting(int(cp_size), False, tuple(int(x) for x in starts // local_len),
                                tuple(int(x) for x in (stops - 1) // local_len), local_rows)


def cu_seqlens_to_seq_idx(cu_seqlens) -> np.ndarray:
    """int [N + 1] cumulative lengths (nondecreasing: empty sequences own no token) -> int64 [1, T]
    sequence ids, the index of each token's sequence."""
    cu = to_host_int_array(cu_seqlens, "cu_seqlens")
    if cu.ndim != 1 or cu.shape[0] < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] <= 0:
        raise ValueError(f"cu_seqlens must be [0, ...] nondecreasing to T > 0 with ≥ 2 entries; "
                         f"received {cu.tolist()}")
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
    """Exchange plan for block-diagonal attention under CP (docs/design.md §3), identical on every rank."""
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


# --------------------------------------------------------------------------- exchange policy


def resolve_exchange_mode(mode: str, plan: BlockDiagPlan) -> str:
    """The exchange a plan runs for ``mode``: "auto" -> "halo" when every straddle fits in the left
    neighbour (``plan.use_halo``), else "a2a"; a forced mode is validated (ValueError when "halo"
    cannot serve the plan). Every rank resolves the same replicated plan the same way."""
    if mode not in MODE_CHOICES:
        raise ValueError(f"mode must be one of {MODE_CHOICES}; received {mode!r}")
    if mode == "auto":
        return "halo" if plan.use_halo else "a2a"
    if mode == "halo" and not plan.use_halo:
        worst = int(np.argmax(plan.back))
        raise ValueError(
            f"mode='halo' needs every document straddle to fit in the left neighbour (back[r] <= L = "
            f"{plan.local_len}), but rank {worst}'s first document starts {plan.back[worst]} tokens before its "
            f"shard (back = {list(plan.back)}): a document spans more than two ranks. Use mode='a2a' or 'auto'")
    return mode


@dataclass(frozen=True)
class ExchangeRouting:
    """What one rank receives in one direction of the exchange (host ints, no tensors).

    mode                 the resolved exchange: "allgather" | "halo" | "a2a"
    window_start         global position of row 0 of the received (token-major) window
    key_start, key_stop  the global key range the rank attends to, ``[s_first[r], real_end[r])``
    halo_len             rows received from the left neighbour (mode "halo")
    in_splits, out_splits, send_index   the needed-only all-to-all-v (mode "a2a"; see
                         ``needed_kv_a2a_splits``), else empty
    """

    mode: str
    rank: int
    window_start: int
    key_start: int
    key_stop: int
    halo_len: int = 0
    in_splits: tuple[int, ...] = ()
    out_splits: tuple[int, ...] = ()
    send_index: np.ndarray | None = None


def exchange_routing(plan: BlockDiagPlan, mode: str, rank: int) -> ExchangeRouting:
    """Rank ``rank``'s routing of the exchange ``mode`` ("auto" resolves) for ``plan``."""
    _check_cp(rank, plan.cp_size)
    resolved = resolve_exchange_mode(mode, plan)
    key_start, key_stop = plan.s_first[rank], plan.real_end[rank]
    shard_start = rank * plan.local_len
    if resolved == "allgather":
        return ExchangeRouting(resolved, rank, 0, key_start, key_stop)
    if resolved == "halo":
        return ExchangeRouting(resolved, rank, shard_start - plan.halo_len, key_start, key_stop, plan.halo_len)
    in_splits, out_splits, send_index = needed_kv_a2a_splits(plan, rank)
    return ExchangeRouting(resolved, rank, key_start, key_start, key_stop, 0, tuple(in_splits), tuple(out_splits),
                           send_index)


def size_class(tokens: int, cap: int, bucket: bool) -> int:
    """Static buffer length for ``tokens`` rows: the next power of two (capped at ``cap``), or exact."""
    if tokens <= 0:
        return 0
    if not bucket:
        return tokens
    return min(cap, 1 << (tokens - 1).bit_length())


@dataclass(frozen=True)
class ExchangeShape:
    """The static sizes an exchange runs with (what a compiled program is specialised on).

    mode        "allgather" | "halo" | "a2a";  a2a_impl  "exact" | "ragged" | "ppermute" for "a2a", else ""
    halo_len    rows from the left neighbour (mode "halo"; bucketed: the max back rounded up)
    piece_lens  rows sent over rank distance 1..cp-1 (a2a "ppermute": a suffix of the source shard)
    recv_len, send_len   receive / send buffer rows of every rank (a2a "ragged")
    """

    mode: str
    a2a_impl: str = ""
    halo_len: int = 0
    piece_lens: tuple[int, ...] = ()
    recv_len: int = 0
    send_len: int = 0


def ppermute_piece_lens(plan: BlockDiagPlan, bucket: bool) -> tuple[int, ...]:
    """Rows sent over rank distance s = 1..cp-1: the largest suffix any rank needs from s ranks back."""
    cp, length = plan.cp_size, plan.local_len
    lens = []
    for distance in range(1, cp):
        widest = 0
        for dst in range(distance, cp):
            start, stop = plan.recv[dst][dst - distance]
            widest = max(widest, stop - start)
        lens.append(size_class(widest, length, bucket))
    return tuple(lens)


def _remote_sizes(plan: BlockDiagPlan) -> list[list[int]]:
    """[src][dst]: tokens src sends to another rank dst."""
    cp = plan.cp_size
    return [[0 if dst == src else plan.send[src][dst][1] - plan.send[src][dst][0] for dst in range(cp)]
            for src in range(cp)]


def ragged_buffer_lens(plan: BlockDiagPlan, bucket: bool) -> tuple[int, int]:
    """(recv_len, send_len): rows of every rank's receive and send buffers of a ragged all-to-all."""
    cp, length = plan.cp_size, plan.local_len
    recv_len = size_class(max(plan.back), (cp - 1) * length, bucket)
    send_len = size_class(max(sum(row) for row in _remote_sizes(plan)), (cp - 1) * length, bucket)
    return recv_len, send_len


def ragged_routing(plan: BlockDiagPlan, shape: ExchangeShape) -> tuple[np.ndarray, ...]:
    """Per-rank tables of a ragged all-to-all (rank-indexed rows, int32), for ``shape`` of mode "a2a".

    Receive buffer of rank r: ``recv_len`` rows, right-aligned so that row j holds global token
    ``r*L - recv_len + j``; the piece from ``src`` lands at ``recv_len - (r*L - start)``. Send
    buffer of rank r: its pieces for destinations 0..cp-1 concatenated (``send_index`` = local
    rows), so overlapping pieces for different destinations occupy distinct rows.
    Returns (send_index [cp, send_len], input_offsets, send_sizes, output_offsets, recv_sizes [cp, cp]).
    """
    cp, length = plan.cp_size, plan.local_len
    remote_sizes = _remote_sizes(plan)
    send_index = np.zeros((cp, max(shape.send_len, 1)), np.int32)
    input_offsets = np.zeros((cp, cp), np.int32)
    send_sizes = np.zeros((cp, cp), np.int32)
    output_offsets = np.zeros((cp, cp), np.int32)
    for src in range(cp):
        cursor = 0
        for dst in range(cp):
            size = remote_sizes[src][dst]
            if size == 0:
                continue
            start, _ = plan.send[src][dst]
            send_index[src, cursor: cursor + size] = np.arange(start, start + size) - src * length
            input_offsets[src, dst] = cursor
            send_sizes[src, dst] = size
            output_offsets[src, dst] = shape.recv_len - (dst * length - start)
            cursor += size
    recv_sizes = np.ascontiguousarray(send_sizes.T)  # recv_sizes[dst][src] = send_sizes[src][dst]
    return send_index, input_offsets, send_sizes, output_offsets, recv_sizes


def exchange_shape(plan: BlockDiagPlan, mode: str, *, a2a_impl: str = "exact", bucket: bool = False) -> ExchangeShape:
    """The static sizes of the exchange ``mode`` ("auto" resolves) runs for ``plan``.

    ``bucket`` rounds sizes up to powers of two (fewer distinct compiled programs, at most twice the
    exact rows); ``a2a_impl`` says how "a2a" runs (torch: "exact"; JAX: "ragged" or "ppermute").
    """
    if a2a_impl not in A2A_IMPLEMENTATIONS:
        raise ValueError(f"a2a_impl must be one of {A2A_IMPLEMENTATIONS}; received {a2a_impl!r}")
    resolved = resolve_exchange_mode(mode, plan)
    if resolved == "allgather":
        return ExchangeShape(resolved)
    if resolved == "halo":
        return ExchangeShape(resolved, halo_len=size_class(plan.halo_len, plan.local_len, bucket))
    if a2a_impl == "ppermute":
        return ExchangeShape(resolved, a2a_impl, piece_lens=ppermute_piece_lens(plan, bucket))
    if a2a_impl == "ragged":
        recv_len, send_len = ragged_buffer_lens(plan, bucket)
        return ExchangeShape(resolved, a2a_impl, recv_len=recv_len, send_len=send_len)
    return ExchangeShape(resolved, a2a_impl)


def widest_exchange_shape(mode: str, cp_size: int, local_len: int, *, a2a_impl: str = "exact") -> ExchangeShape:
    """The static sizes of ``mode`` that serve *every* packing of ``cp_size`` shards of ``local_len``
    tokens that the mode can serve: halo ``L`` rows; ppermute a2a ``L`` rows per rank distance;
    ragged a2a buffers of ``(cp - 1) * L`` rows. A program compiled for it never needs another
    (no retrace for a new packing), at the price of moving the widest pieces every time: halo L
    rows from the neighbour, ppermute a2a ``cp (cp - 1) L / 2`` rows in all, half the all-gather's.
    """
    if mode not in EXCHANGE_MODES:
        raise ValueError(f"mode must be one of {EXCHANGE_MODES} (a resolved mode, not 'auto'); received {mode!r}")
    if mode == "allgather":
        return ExchangeShape(mode)
    if mode == "halo":
        return ExchangeShape(mode, halo_len=local_len if cp_size > 1 else 0)
    if a2a_impl == "ppermute":
        return ExchangeShape(mode, a2a_impl, piece_lens=(local_len,) * (cp_size - 1))
    if a2a_impl == "ragged":
        rows = (cp_size - 1) * local_len
        return ExchangeShape(mode, a2a_impl, recv_len=rows, send_len=rows)
    if a2a_impl != "exact":
        raise ValueError(f"a2a_impl must be one of {A2A_IMPLEMENTATIONS}; received {a2a_impl!r}")
    return ExchangeShape(mode, a2a_impl)


def exchange_shape_error(plan: BlockDiagPlan, shape: ExchangeShape) -> str | None:
    """Why ``shape`` cannot serve ``plan``, or None: every static size must cover what each rank needs
    and stay within the shard (a larger size is fine: the extra rows belong to other documents and
    the doc mask drops them). Used to reject an edited exchange description (tamper evidence)."""
    cp, length = plan.cp_size, plan.local_len
    if shape.mode not in EXCHANGE_MODES:
        return f"mode {shape.mode!r} is not a resolved exchange {EXCHANGE_MODES}"
    if shape.mode != "a2a" and (shape.a2a_impl or shape.piece_lens or shape.recv_len or shape.send_len):
        return f"mode {shape.mode!r} carries a2a sizes {shape}"
    if shape.mode == "halo" and (not plan.use_halo or not plan.halo_len <= shape.halo_len <= length):
        return f"halo_len = {shape.halo_len} must lie in [{plan.halo_len}, L = {length}] (back = {list(plan.back)})"
    if shape.mode != "halo" and shape.halo_len:
        return f"mode {shape.mode!r} carries halo_len = {shape.halo_len}"
    if shape.mode == "a2a" and shape.a2a_impl == "ppermute":
        needed = ppermute_piece_lens(plan, bucket=False)
        if len(shape.piece_lens) != cp - 1 or any(not n <= p <= length for n, p in zip(needed, shape.piece_lens)):
            return f"piece_lens = {shape.piece_lens} must cover {needed} and stay ≤ L = {length}"
    if shape.mode == "a2a" and shape.a2a_impl == "ragged":
        recv_len, send_len = ragged_buffer_lens(plan, bucket=False)
        if not (recv_len <= shape.recv_len <= (cp - 1) * length and send_len <= shape.send_len <= (cp - 1) * length):
            return f"recv_len, send_len = {shape.recv_len}, {shape.send_len} must cover {recv_len}, {send_len}"
    if shape.mode == "a2a" and shape.a2a_impl not in ("ragged", "ppermute", "exact"):
        return f"a2a_impl {shape.a2a_impl!r} is not one of ('exact', 'ragged', 'ppermute')"
    return None


def exchange_tokens_received(plan: BlockDiagPlan, mode) -> list[int]:
    """Tokens of K/V each rank receives from other ranks in one direction of an exchange.

    ``mode``: a mode name ("auto" resolves; sizes exact) or an ``ExchangeShape`` (sizes as it runs:
    static, bucketed sizes travel in full). all-gather: every other shard; halo: ``halo_len`` from the
    left neighbour (rank 0 gets none); a2a: only the needed tokens that live elsewhere ("exact" and
    "ragged"), or the static pieces per rank distance ("ppermute"). The backward moves the same amounts.
    """
    shape = mode if isinstance(mode, ExchangeShape) else exchange_shape(plan, mode)
    cp, length = plan.cp_size, plan.local_len
    if shape.mode == "allgather":
        return [(cp - 1) * length] * cp
    if shape.mode == "halo":
        return [0] + [shape.halo_len] * (cp - 1)
    if shape.a2a_impl == "ppermute":
        return [sum(shape.piece_lens[:rank]) for rank in range(cp)]
    return [sum(stop - start for src, (start, stop) in enumerate(plan.recv[rank]) if src != rank) for rank in range(cp)]


def exchange_bytes(plan: BlockDiagPlan, mode, *, batch: int, kv_heads: int, head_dim: int,
                   itemsize: int) -> dict[str, int]:
    """Bytes of K and V one forward exchange moves: total over ranks and the busiest rank's share.

    ``mode`` as in ``exchange_tokens_received`` (a name or an ``ExchangeShape``)."""
    per_token = 2 * batch * kv_heads * head_dim * itemsize  # K and V travel together
    received = exchange_tokens_received(plan, mode)
    return {"total": sum(received) * per_token, "max_per_rank": max(received) * per_token}
