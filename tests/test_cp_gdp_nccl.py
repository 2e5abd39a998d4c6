"""benchmarks/cp_gdp_nccl.py's ``--fla`` on the CPU: the script and its ``--help`` load without
flash-linear-attention, ``--fla`` without it stops with a clear message before any GPU work or spawn,
and FLA 0.6's per-rank CP context (``build_cp_context`` from the GLOBAL cu_seqlens and a 2-rank gloo
group, through fla_baseline.fla_cp_context) gives each rank the documents and document spans of our
``PackedSequenceCPMetadata``. FLA's Triton kernels need a GPU; its context is host code.
"""

import importlib
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from cp_linear import build_packed_sequence_cp_metadata

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
POOL_TIMEOUT_S = 120  # importing FLA in the workers takes seconds; the contexts are host code

# Document lengths over T = 48 (L = 24 per rank): uneven documents, one crossing the boundary; one document
# spanning both ranks; a document ending exactly at the boundary; short documents only; a long first and
# a one-token last document; the brief's 64k layout scaled down (cp_gdp_nccl._lengths).
LAYOUTS = [
    pytest.param([6, 24, 15, 3], id="uneven-crossing"),
    pytest.param([48], id="one-spanning"),
    pytest.param([10, 14, 24], id="ends-at-boundary"),
    pytest.param([5] * 9 + [3], id="short-only"),
    pytest.param([47, 1], id="long-then-one"),
]


def _benchmark_module(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def _cu_seqlens(lengths):
    import torch

    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)


def fla_context_in_rank(rank, world, lengths):
    """On every rank: FLA's context against our metadata of the same rank, and against the other rank's."""
    baseline = _benchmark_module("fla_baseline")
    context = baseline.fla_cp_context(_cu_seqlens(lengths), dist.group.WORLD)
    seq_idx = np.repeat(np.arange(len(lengths)), lengths).reshape(1, -1)
    ours = build_packed_sequence_cp_metadata(seq_idx, rank, world)
    other = build_packed_sequence_cp_metadata(seq_idx, (rank + 1) % world, world)
    return (baseline.fla_cp_context_mismatches(context, ours), baseline.fla_cp_context_mismatches(context, other),
            context.cu_seqlens.tolist())


@pytest.mark.multirank
@pytest.mark.parametrize("lengths", LAYOUTS)
def test_fla_cp_context_agrees_with_our_metadata_per_rank(gloo_pools, lengths):
    pytest.importorskip("fla.ops.cp")  # flash-linear-attention is not a dependency: skipped without it
    results = gloo_pools(2).run(fla_context_in_rank, lengths, timeout=POOL_TIMEOUT_S)
    for rank, (same_rank, _, local_cu) in enumerate(results):
        assert same_rank == [], f"rank {rank}: {same_rank}"
        assert local_cu[0] == 0 and local_cu[-1] == sum(lengths) // 2
    # the comparison can fail: the two ranks' contexts differ for every layout here
    assert all(other_rank for _, other_rank, _ in results)


def test_fla_cp_context_mismatches_names_each_disagreeing_field():
    """The comparison itself, without FLA: a stand-in context one rank off, field by field."""
    from types import SimpleNamespace

    import torch

    baseline = _benchmark_module("fla_baseline")
    seq_idx = np.repeat([0, 1, 2], [5, 4, 7]).reshape(1, -1)  # plan.py's worked example, 4 ranks of 4
    meta = build_packed_sequence_cp_metadata(seq_idx, 1, 4)  # local cu [0, 1, 4], preceding from 0, following to 3
    agreeing = SimpleNamespace(layout="contiguous", cu_seqlens=torch.tensor([0, 1, 4], dtype=torch.int32),
                               pre_num_ranks=1, post_num_ranks=1, is_first_rank=False, is_last_rank=False,
                               pre_num_conv_tokens=4)
    assert baseline.fla_cp_context_mismatches(agreeing, meta) == []
    off = SimpleNamespace(**dict(vars(agreeing), post_num_ranks=0, is_last_rank=True, pre_num_conv_tokens=3))
    received = baseline.fla_cp_context_mismatches(off, meta)
    assert [line.split(":")[0] for line in received] == ["post_num_ranks", "is_last_rank", "pre_num_conv_tokens"]
    assert received[0] == "post_num_ranks: FLA 0 vs ours 1"


def test_help_and_missing_fla_need_no_fla(monkeypatch, capsys):
    """Without FLA (its import blocked) the script loads, --help prints, and --fla returns 2 with the reason."""
    for name in [name for name in sys.modules if name == "fla" or name.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla` raises ImportError
    spec = importlib.util.spec_from_file_location("cp_gdp_nccl_without_fla", BENCHMARKS / "cp_gdp_nccl.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help"])
    assert exit_info.value.code == 0 and "--fla" in capsys.readouterr().out
    assert script.main(["--fla", "--backward"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("--fla needs flash-linear-attention 0.6") and "No module named 'fla" in out
