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
``batch_isend_irecv``: a shift round (position i takes the summary of i - 1), then rounds with
offsets 1, 2, 4, ... in which position i folds in what i - offset holds::

    positions   0     1     2     3          (one sequence over 4 ranks, forward)
    shift       -    s0    s1    s2
    offset 1    -    s0   s0s1  s1s2
    offset 2    -    s0   s0s1  s0s1s2        rank 3's incoming summary = fold(s0, s1, s2)

Every rank knows every rank's ``stops`` / ``empty`` from the replicated ids
(``cp_linear.plan.SequenceStateRouting``), so sender and receiver agree on each message without
communicating, and nothing is sent to a position whose fold is already complete. Cost: at most
1 + ceil(log2 cp) rounds, at most that many summaries received per rank, two summaries of memory
(held and received). The result is one folded summary ``[1, ...]`` (``[0, ...]`` when empty), whose
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
# "auto" scans above this group size: on gloo (CPU, 2 cores) the all-gather is faster at 2 and 4
# ranks, the scan from 8 (benchmarks/bench_summary_exchange.py, docs/cp_options.md)
SCAN_MIN_WORLD = 8


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

    rounds[k] = the (sender position, receiver position) pairs of round k; round 0 is the shift.
    """

    world: int
    descending: bool
    empty: tuple[bool, ...]
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
    """The scan's messages for the forward (ascending ranks) or the backward (descending)."""
    world = routing.cp_size
    ranks = range(world - 1, -1, -1) if descending else range(world)
    if descending:
        stops = [routing.leading_ends_here(r) for r in ranks]
        empty = [all(routing.ends_here(r)[-1:]) for r in ranks]
    else:
        stops = [routing.trailing_starts_here(r) for r in ranks]
        empty = [not routing.first_row_continues(r) for r in ranks]
    empty[0] = True
    # closed[i]: position i's fold is complete; low[i]: the lowest summary position it covers
    closed = [empty[i] or stops[i - 1] for i in range(world)]
    low = [i - 1 for i in range(world)]
    rounds = [tuple((i - 1, i) for i in range(1, world) if not empty[i])]
    offset = 1
    while offset < world:
        messages = tuple((i - offset, i) for i in range(offset, world) if not closed[i] and low[i] > 0)
        new_closed, new_low = list(closed), list(low)  # every message of a round carries the previous round's value
        for sender, receiver in messages:
            new_closed[receiver], new_low[receiver] = closed[sender], low[sender]
        closed, low = new_closed, new_low
        rounds.append(messages)
        offset *= 2
    return ScanSchedule(world, descending, tuple(empty), tuple(rounds))


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
    rank = dist.get_rank(group)
    position = schedule.position_of(rank)
    held = mine
    received = torch.empty_like(mine)
    for index, messages in enumerate(schedule.rounds):
        ops, got = [], False
        for sender, receiver in messages:
            if sender == position:
                ops.append(dist.P2POp(dist.isend, held, dist.get_global_rank(group, schedule.rank_at(receiver)),
                                      group))
            if receiver == position:
                ops.append(dist.P2POp(dist.irecv, received, dist.get_global_rank(group, schedule.rank_at(sender)),
                                      group))
                got = True
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        if got:
            # the shift replaces (position i starts from summary i - 1); later rounds fold the earlier part in
            held = received.clone() if index == 0 else combine(received, held)
    if schedule.empty[position]:
        return _in_form_of(summary, mine.new_empty((0, *mine.shape)))
    return _in_form_of(summary, held.unsqueeze(0))


def summary_bytes(summary) -> int:
    """Bytes of one summary as it travels (float32)."""
    return _as_packed(summary).numel() * 4
