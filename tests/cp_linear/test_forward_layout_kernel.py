"""The layout kernel (``cp_linear.kernels.forward_layout``): ``forward_layout``'s tables in one launch.

On the CPU: ``ForwardLayoutLaunch.of`` folds forward_layout's single-sequence rules into the flags and
sizes its tables as the layout does, and the emulation (forward_layout itself) fills every table and the
trailing sequence. On a GPU (marked ``gpu``): the kernel against ``forward_layout`` on the same device,
table for table, exactly (``benchmarks/check_tc_kernels.py --layout-only`` sweeps many more shards).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_linear.kernels import configs as kcfg
from cp_linear.kernels import launch as kl
from cp_linear.kernels.emulation import run_emulated


def _case(lengths, *, n_h, segment_chunks, summary, grad, padding=0, device="cpu", values_only=None):
    """(launch with sentinel-filled outputs, the expected forward_layout, the last sequence with tokens)."""
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    total = max(int(cu[-1]) + padding, 1)
    sizes = kl.layout_sizes(total_tokens=total, num_householder=n_h, num_sequences=len(lengths), heads=16,
                            row_blocks=2, sm_count=132, segment_chunks=segment_chunks)
    tables = {name: torch.full((size,), -7, dtype=torch.int32, device=device)
              for name, size in sizes.table_sizes().items()}
    trailing = torch.full((1,), -7, dtype=torch.int32, device=device)
    launch = kl.ForwardLayoutLaunch.of(cu, tables, trailing, num_householder=n_h, sizes=sizes,
                                       summary_sequence=summary, grad_summary_sequence=grad,
                                       values_only_from=values_only)
    nonempty = [n for n, length in enumerate(lengths) if length]
    last = nonempty[-1] if nonempty else 0
    expected = kl.forward_layout(cu, total_tokens=total, num_householder=n_h, heads=16, row_blocks=2, sm_count=132,
                                 segment_chunks=sizes.segment_chunks,
                                 summary_sequence=last if summary == kcfg.TRAILING_SEQUENCE else summary,
                                 grad_summary_sequence=grad, values_only_from=values_only)
    return launch, expected, last


CASES = [
    pytest.param([300], 2, 2, kcfg.TRAILING_SEQUENCE, 0, 0, id="one-sequence-cp"),
    pytest.param([0], 1, 4, None, None, 17, id="one-empty-sequence"),
    pytest.param([0, 130, 0, 64, 1, 0], 2, 1, kcfg.TRAILING_SEQUENCE, 0, 5, id="empties-trailing-summary"),
    pytest.param([129, 0, 700, 33], 3, 3, 0, None, 0, id="summary-of-sequence-0"),
    pytest.param([0, 0, 0], 1, 8, kcfg.TRAILING_SEQUENCE, 0, 9, id="no-tokens"),
    pytest.param(list(np.random.default_rng(5).integers(0, 400, 200)), 2, 3, kcfg.TRAILING_SEQUENCE, 0, 0,
                 id="shorter-segments-sorted"),
]
# (lengths, n_h, segment_chunks, summary, grad, padding, values_only_from): first segments from zero rows
VALUES_ONLY_CASES = [
    pytest.param([0, 130, 0, 64, 1, 0], 2, 1, kcfg.TRAILING_SEQUENCE, 0, 5, 1, id="cp-values-only-from-1"),
    pytest.param([129, 0, 700, 33], 3, 1, None, None, 0, 0, id="lean-values-only-from-0"),
    pytest.param([300], 2, 2, None, None, 0, 0, id="one-sequence-values-only"),
]


def test_single_sequence_rules_fold_into_the_flags():
    """forward_layout: a single sequence's summary sequence can only be itself, so every segment is
    summarised; with more sequences the trailing one is found on the device (-2 stays)."""
    launch, _, _ = _case([300], n_h=2, segment_chunks=2, summary=kcfg.TRAILING_SEQUENCE, grad=0)
    assert (launch.every_segment_summary, launch.every_segment_grad_summary) == (1, 1)
    launch, _, _ = _case([30, 40], n_h=2, segment_chunks=2, summary=kcfg.TRAILING_SEQUENCE, grad=None)
    assert (launch.summary_sequence, launch.grad_summary_sequence) == (kcfg.TRAILING_SEQUENCE, -1)
    assert (launch.every_segment_summary, launch.every_segment_grad_summary) == (0, 0)


@pytest.mark.parametrize("lengths, n_h, segment_chunks, summary, grad, padding", CASES)
def test_the_emulation_fills_every_table(lengths, n_h, segment_chunks, summary, grad, padding):
    launch, expected, last = _case(lengths, n_h=n_h, segment_chunks=segment_chunks, summary=summary, grad=grad,
                                   padding=padding)
    run_emulated(launch)
    for name in kl.LAYOUT_TABLES:
        assert torch.equal(getattr(launch, name), getattr(expected, name)), name
    assert int(launch.trailing[0]) == last


@pytest.mark.parametrize("lengths, n_h, segment_chunks, summary, grad, padding, values_only", VALUES_ONLY_CASES)
def test_values_only_flags(lengths, n_h, segment_chunks, summary, grad, padding, values_only):
    """The emulation writes forward_layout's VALUES_ONLY_FLAG bits: on summarised first segments of sequences
    from ``values_only`` on, and nowhere else (the grad flags' forward bit reads bit 0 only)."""
    launch, expected, _ = _case(lengths, n_h=n_h, segment_chunks=segment_chunks, summary=summary, grad=grad,
                                padding=padding, values_only=values_only)
    run_emulated(launch)
    for name in kl.LAYOUT_TABLES:
        assert torch.equal(getattr(launch, name), getattr(expected, name)), name
    flags, first = launch.seg_flags.tolist(), launch.seq_first_segment.tolist()
    flagged = [s for s, f in enumerate(flags) if f & kcfg.VALUES_ONLY_FLAG]
    wanted = [first[n] for n in range(values_only, len(lengths)) if lengths[n] and flags[first[n]] & 1]
    assert flagged == wanted and wanted


@pytest.mark.gpu
@pytest.mark.parametrize("lengths, n_h, segment_chunks, summary, grad, padding", CASES + [
    pytest.param(list(np.random.default_rng(3).integers(0, 90, kcfg.LAYOUT_MAX_SEQUENCES)), 2, 3,
                 kcfg.TRAILING_SEQUENCE, 0, 0, id="most-sequences")])
@pytest.mark.parametrize("values_only", [None, 1])
def test_the_kernel_writes_forward_layouts_tables(lengths, n_h, segment_chunks, summary, grad, padding, values_only):
    launch, expected, last = _case(lengths, n_h=n_h, segment_chunks=segment_chunks, summary=summary, grad=grad,
                                   padding=padding, device="cuda", values_only=values_only)
    launch.run()
    for name in kl.LAYOUT_TABLES:
        assert torch.equal(getattr(launch, name), getattr(expected, name)), name
    assert int(launch.trailing[0]) == last
