"""The torch execution of the GDP summary exchange: the log-depth scan over ``batch_isend_irecv``.

The choice ("all_gather" | "scan" | "auto") and the scan's schedule are framework-neutral
(``cp_linear.summary_exchange``, with the glossary and a worked example); this module sends the
scheduled messages. Every rank derives the whole schedule from the replicated ids
(``cp_linear.plan.SequenceStateRouting``), so sender and receiver agree on each message without
communicating, and nothing is sent to a position whose fold is already complete. The result is one
folded summary ``[1, ...]`` (``[0, ...]`` when empty), whose fold equals the fold of the all-gather
slice up to float32 reassociation.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch
import torch.distributed as dist

from cp_linear.summary import (
    CPBackwardPackedSummary,
    CPBackwardUnpackedSummary,
    CPForwardPackedSummary,
    CPForwardUnpackedSummary,
    as_packed_array,
    combine,
    unpack,
)
from cp_linear.summary_exchange import (  # noqa: F401  (the choice and schedule, re-exported for torch callers)
    SCAN_MIN_WORLD,
    SUMMARY_EXCHANGES,
    ScanSchedule,
    resolve_summary_exchange,
    scan_schedule,
)


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
