"""How CP ranks exchange GDP summaries: one all-gather, or a log-depth scan over point-to-point sends.

Glossary
  position   a rank's place in the scan order: rank order forward, reversed rank order backward
  stops[j]   the summary at position j ignores everything before it (forward: the rank's trailing
             sequence starts on it, so M = 0 or the fold begins there; backward: its leading
             sequence ends on it): a fold that reaches j needs nothing earlier
  empty[i]   position i needs no summary at all (forward: the rank's first token starts a sequence;
             backward: its last token ends one)

"all_gather" (docs/design.md §2): every rank receives all cp summaries and slices its range;
memory cp summaries per rank, bytes (cp - 1) summaries received per rank, one collective.

"scan": an exclusive prefix fold of ``combine`` (``cp_linear.summary``) by Hillis-Steele over
``batch_isend_irecv``. Each position holds an inclusive fold (starting as its own summary) and an
exclusive one (starting empty); in the round with offset 1, 2, 4, ... position i receives the
inclusive fold of i - offset and folds it into both::

    positions (exclusive)   0     1     2       3          (one sequence over 4 ranks, forward)
    offset 1                -    s0    s1      s2
    offset 2                -    s0   s0s1   s0s1s2        rank 3's incoming summary = fold(s0, s1, s2)

Every rank knows every rank's ``stops`` / ``empty`` from the replicated ids
(``cp_linear.plan.SequenceStateRouting``), so sender and receiver agree on each message without
communicating, and nothing is sent to a position whose fold is already complete. Cost: at most
ceil(log2 cp) rounds and that many summaries received per rank; four summaries of memory (own
inclusive fold, exclusive fold, receive buffer, and the fold being formed). The result is one folded summary ``[1, ...]`` (``[0, ...]`` when empty), whose
fold equals the fold of the all-gather slice up to float32 reassociation.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist

from cp_linear.plan import SequenceStateRouting
from cp_linear.summary import (
    CPBackwardPackedSummary,
    CPBackwardUnpackedSummary,
    CPForwardPackedSummary,
    CPForwardUnpackedSummary,
    as_packed_array,
    combine,
    unpack,
)

SUMMARY_EXCHANGES = ("all_gather", "scan", "auto")
# "auto" scans from this group size: on gloo (CPU, 2 cores) the all-gather was faster at 4 and 8
# ranks (benchmarks/bench_summary_exchange.py, docs/cp_options.md); beyond, the scan saves memory (O(1) vs O(cp))
SCAN_MIN_WORLD = 16


def resolve_summary_exchange(summary_exchange: str, world: int) -> str | None:
    """"all_gather" / "scan" for a valid choice ("auto" by group size), None for an invalid one (the caller
    reports it through the agreement so that every rank raises)."""
    if summary_exchange not in SUMMARY_EXCHANGES:
        return None
    if summary_exchange == "auto":
        return "scan" if world >= SCAN_MIN_WORLD else "all_gather"
    return summary_exchange


@dataclass(frozen=True)
class ScanSchedule:
    """The messages of one direction's scan, identical on every rank (host ints).

    rounds[k] = the (sender position, receiver position) pairs of round k (offset 2^k).
    """

    world: int
    descending: bool
    empty: tuple[bool, ...]
    stops: tuple[bool, ...]
    rounds: tuple[tuple[tuple[int, int], ...], ...]

    def rank_at(self, position: int) -> int:
        return self.world - 1 - position if self.descending else position

    def position_of(self, rank: int) -> int:
        return self.world - 1 - rank if self.descending else rank

    def received_per_rank(self) -> list[int]:
        """Summaries each rank receives (indexed by rank)."""
        counts = [0] * self.world
        for messages in self.rounds:
            for _, receiver in messages:
                counts[self.rank_at(receiver)] += 1
        return counts


def scan_schedule(routing: SequenceStateRouting, *, descending: bool) -> ScanSchedule:
    """The scan's messages for the forward (ascending ranks) or the backward (descending).

    Each position keeps an inclusive fold (its own summary and what came before) and an exclusive one
    (what came before: the result); round k sends the inclusive fold to position + 2^k. ``closed``
    tracks, on the host, which folds already reach a stop, so no message goes where nothing is missing.
    """
    world = routing.cp_size
    ranks = range(world - 1, -1, -1) if descending else range(world)
    if descending:
        stops = [routing.leading_ends_here(r) for r in ranks]
        empty = [all(routing.ends_here(r)[-1:]) for r in ranks]
    else:
        stops = [routing.trailing_starts_here(r) for r in ranks]
        empty = [not routing.first_row_continues(r) for r in ranks]
    empty[0] = True
    inclusive_closed, exclusive_closed = list(stops), list(empty)
    rounds = []
    offset = 1
    while offset < world:
        messages = tuple((i - offset, i) for i in range(offset, world) if not exclusive_closed[i])
        # every message of a round carries the previous round's folds
        new_inclusive, new_exclusive = list(inclusive_closed), list(exclusive_closed)
        for sender, receiver in messages:
            new_exclusive[receiver] = inclusive_closed[sender]
            new_inclusive[receiver] = inclusive_closed[receiver] or inclusive_closed[sender]
        inclusive_closed, exclusive_closed = new_inclusive, new_exclusive
        rounds.append(messages)
        offset *= 2
    return ScanSchedule(world, descending, tuple(empty), tuple(stops), tuple(rounds))


def _as_packed(summary) -> torch.Tensor:
    return as_packed_array(summary).contiguous()


def _in_form_of(summary, folded: torch.Tensor):
    """The folded packed stack [n, ...] in the form ``summary`` came in (packed / unpacked / tensor)."""
    if isinstance(summary, torch.Tensor):
        return folded
    if isinstance(summary, CPForwardPackedSummary):
        return CPForwardPackedSummary(folded)
    if isinstance(summary, CPBackwardPackedSummary):
        return CPBackwardPackedSummary(folded)
    packed_form = CPForwardPackedSummary if isinstance(summary, CPForwardUnpackedSummary) else CPBackwardPackedSummary
    parts = unpack(packed_form(folded))
    return replace(parts, **{f.name: getattr(parts, f.name).contiguous() for f in fields(parts)})


def scan_exchange(summary, group: dist.ProcessGroup, schedule: ScanSchedule):
    """This rank's folded neighbour summary, stacked [1, ...] ([0, ...] when it needs none), in the
    form ``summary`` came in. Forward: fold of the preceding ranks' summaries, ascending; backward
    (``schedule.descending``): of the following ranks', descending (docs/design.md §2)."""
    assert isinstance(summary, (torch.Tensor, CPForwardPackedSummary, CPBackwardPackedSummary,
                                CPForwardUnpackedSummary, CPBackwardUnpackedSummary))
    mine = _as_packed(summary)
    position = schedule.position_of(dist.get_rank(group))
    inclusive, exclusive = mine, None  # None: nothing folded yet (the identity)
    inclusive_done = schedule.stops[position]  # a stop: nothing earlier changes the inclusive fold
    received = torch.empty_like(mine)
    for messages in schedule.rounds:
        ops, got = [], False
        for sender, receiver in messages:
            if sender == position:
                peer = dist.get_global_rank(group, schedule.rank_at(receiver))
                ops.append(dist.P2POp(dist.isend, inclusive, peer, group))
            if receiver == position:
                peer = dist.get_global_rank(group, schedule.rank_at(sender))
                ops.append(dist.P2POp(dist.irecv, received, peer, group))
                got = True
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        if got:  # the received fold covers positions before both of ours
            exclusive = received.clone() if exclusive is None else combine(received, exclusive)
            if not inclusive_done:
                inclusive = combine(received, inclusive)
    if schedule.empty[position]:
        return _in_form_of(summary, mine.new_empty((0, *mine.shape)))
    return _in_form_of(summary, exclusive.unsqueeze(0))


def summary_bytes(summary) -> int:
    """Bytes of one summary as it travels (float32)."""
    return _as_packed(summary).numel() * 4
