"""How CP ranks exchange GDP summaries, framework-neutral: the choice and the log-depth scan's bookkeeping.

Glossary
  position   a rank's place in the scan order: rank order forward, reversed rank order backward
  stops[j]   the summary at position j ignores everything before it (forward: the rank's trailing
             sequence starts on it, so M = 0 or the fold begins there; backward: its leading
             sequence ends on it): a fold that reaches j needs nothing earlier
  empty[i]   position i needs no summary at all (forward: the rank's first token starts a sequence;
             backward: its last token ends one)
  closed     a fold (inclusive or exclusive) that already reaches a stop (or is empty): folding
             anything earlier into it would cross a sequence start

"all_gather" (docs/design.md §2): every rank receives all cp summaries and slices its range;
memory cp summaries per rank, bytes (cp - 1) summaries received per rank, one collective.

"scan": an exclusive prefix fold of ``combine`` (``cp_linear.summary``) by Hillis-Steele. Each
position holds an inclusive fold (starting as its own summary) and an exclusive one (starting
empty); in the round with offset 1, 2, 4, ... position i receives the inclusive fold of i - offset
and folds it into both::

    positions (exclusive)   0     1     2       3          (one sequence over 4 ranks, forward)
    offset 1                -    s0    s1      s2
    offset 2                -    s0   s0s1   s0s1s2        rank 3's incoming summary = fold(s0, s1, s2)

``scan_round`` is the bookkeeping of one round, array-generic: torch derives the whole message
schedule from it on the host (``scan_schedule``, numpy flags of every position, so nothing is sent
to a position whose fold is complete), JAX runs it per rank on traced flags inside shard_map
(``jax_api.gdp.summary_exchange``: every round one ``ppermute``, receivers that need nothing mask
the received value). Cost: at most ceil(log2 cp) rounds and summaries received per rank, four
summaries of memory; the fold equals the all-gather slice's up to float32 reassociation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cp_linear.plan import SequenceStateRouting

SUMMARY_EXCHANGES = ("all_gather", "scan", "auto")
# "auto" scans from this group size: on gloo (CPU, 2 cores) the all-gather was faster at 4 and 8
# ranks (benchmarks/bench_summary_exchange.py, docs/cp_options.md); beyond, the scan saves memory (O(1) vs O(cp))
SCAN_MIN_WORLD = 16


def resolve_summary_exchange(summary_exchange: str, world: int) -> str | None:
    """"all_gather" / "scan" for a valid choice ("auto" by group size), None for an invalid one (the
    torch caller reports it through the agreement so that every rank raises)."""
    if summary_exchange not in SUMMARY_EXCHANGES:
        return None
    if summary_exchange == "auto":
        return "scan" if world >= SCAN_MIN_WORLD else "all_gather"
    return summary_exchange


def scan_round(inclusive_closed, exclusive_closed, sender_inclusive_closed, has_sender):
    """One Hillis-Steele round's bookkeeping at a receiving position (numpy bool arrays, jax bools).

    ``has_sender``: position - offset exists. Returns (receives: the position folds the sender's
    inclusive fold into its exclusive one, folds_inclusive: into its inclusive one too, and the two
    closed flags after the round). A closed exclusive fold receives nothing; a received fold that is
    closed closes both folds of the receiver (they now reach the same stop).
    """
    receives = has_sender & ~exclusive_closed
    folds_inclusive = receives & ~inclusive_closed
    closes = receives & sender_inclusive_closed
    return receives, folds_inclusive, inclusive_closed | closes, exclusive_closed | closes


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
    """The scan's messages for the forward (ascending ranks) or the backward (descending), from the
    replicated routing: ``scan_round`` run for every position at once, keeping only the receivers."""
    world = routing.cp_size
    ranks = range(world - 1, -1, -1) if descending else range(world)
    if descending:
        stops = [routing.leading_ends_here(r) for r in ranks]
        empty = [all(routing.ends_here(r)[-1:]) for r in ranks]
    else:
        stops = [routing.trailing_starts_here(r) for r in ranks]
        empty = [not routing.first_row_continues(r) for r in ranks]
    empty[0] = True
    inclusive_closed, exclusive_closed = np.array(stops, bool), np.array(empty, bool)
    positions = np.arange(world)
    rounds = []
    offset = 1
    while offset < world:
        senders = np.maximum(positions - offset, 0)  # every message of a round carries the previous round's folds
        receives, _, inclusive_closed, exclusive_closed = scan_round(
            inclusive_closed, exclusive_closed, inclusive_closed[senders], positions >= offset)
        rounds.append(tuple((int(i) - offset, int(i)) for i in np.nonzero(receives)[0]))
        offset *= 2
    return ScanSchedule(world, descending, tuple(empty), tuple(stops), tuple(rounds))


__all__ = ["SCAN_MIN_WORLD", "SUMMARY_EXCHANGES", "ScanSchedule", "resolve_summary_exchange", "scan_round",
           "scan_schedule"]
