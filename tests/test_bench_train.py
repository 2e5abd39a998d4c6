"""benchmarks/bench_train.py imports without a GPU and its --dry-run (tiny model on the CPU, gloo for
CP; with --frameworks torch jax also the JAX row) runs end to end and writes its table and CSV, so the
script cannot rot between GPU sessions.

The CP rank runs in the session's 2-rank gloo pool instead of freshly spawned processes (spawning
two ranks that import torch cost most of the old test's 150 s on CI); ``run_world``'s spawning is
the only part left to the GPU sessions.

No dry run executes in the test process, so none can hang the suite: the torch rows run in the pool
(its tasks time out), and the JAX row's run (torch row, then JAX's compile and step) in a fresh
interpreter under a timeout. In the test process, after the suite's JAX and gloo tests, the JAX
row's compile once hung for 15+ min (XLA idle in ``backend_compile_and_load``), past pytest-timeout,
whose SIGALRM cannot interrupt a wait in C++.
"""

import argparse
import csv
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_train.py"
TOKENS = 32  # --dry-run's tokens per rank
COLUMNS = ["framework", "variant", "gpus", "residual", "tokens_per_gpu", "step_ms", "tokens_per_s", "mfu", "peak_gib"]


def _load():
    """Imported by name, in the test process and in the pool's workers."""
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    return importlib.import_module("bench_train")


POOL_TIMEOUT_S = 120  # per world size; a dry-run row takes seconds


def measure_in_pool(rank, world, args):
    return _load().measure(rank, world, dist.group.WORLD, args)


def measure_alone_in_pool(rank, world, args):
    """The one-device row on the pool's rank 0 (the others idle): under the pool's timeout, not in pytest."""
    return _load().measure(0, 1, None, args) if rank == 0 else None


@pytest.mark.multirank
def test_dry_run_prints_and_writes_a_row_per_world_size(tmp_path, gloo_pools, capsys):
    bench = _load()

    def run(world, args):
        task = measure_alone_in_pool if world == 1 else measure_in_pool
        return [row for row in gloo_pools(2 if world == 1 else world).run(task, args, timeout=POOL_TIMEOUT_S)
                if row is not None]

    rows = bench.main(["--dry-run", "--gpus", "1", "2", "--out", str(tmp_path)], run=run)
    assert [(row["variant"], row["gpus"], row["tokens_per_gpu"]) for row in rows] == [
        ("cp_linear-1gpu", 1, TOKENS), ("cp_linear-2gpu", 2, TOKENS)]
    for row in rows:
        assert 0 < row["step_ms"] < 60e3, row
        # tokens/s is the whole world's tokens over the measured step
        assert row["tokens_per_s"] == pytest.approx(row["gpus"] * TOKENS / (row["step_ms"] / 1e3), rel=1e-9), row
        assert math.isnan(row["mfu"]) and math.isnan(row["peak_gib"]), row  # no GPU: not measured

    with open(tmp_path / "bench_train.csv") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == COLUMNS
        written = list(reader)
    assert [r["variant"] for r in written] == ["cp_linear-1gpu", "cp_linear-2gpu"]
    assert all(float(r["tokens_per_s"]) == pytest.approx(row["tokens_per_s"]) for r, row in zip(written, rows))

    table = capsys.readouterr().out.splitlines()
    header = table.index(" | ".join(COLUMNS))
    assert [line.split(" | ")[1] for line in table[header + 1:header + 3]] == ["cp_linear-1gpu", "cp_linear-2gpu"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "bench_train.png").stat().st_size > 0


def _load_jax_step():
    pytest.importorskip("flax")
    _load()  # puts benchmarks/ on the path
    return importlib.import_module("jax_train_step")


DRY_RUN_TIMEOUT_S = 300  # the run takes 15-30 s on CI's 2 cores, most of it imports and XLA's compile
_DRY_RUN = """
import faulthandler, json, sys
faulthandler.dump_traceback_later({dump_after}, exit=True)  # a hang prints every thread's stack
sys.path.insert(0, {benchmarks!r})
import bench_train
rows = bench_train.main(sys.argv[1:])  # --gpus 1: the torch row in this process, then the JAX row
with open({rows!r}, "w") as handle:
    json.dump(rows, handle)
"""


def dry_run_in_subprocess(argv: list[str], out: Path) -> tuple[list[dict], str]:
    """bench_train.main(argv) in a fresh interpreter with one host device for JAX: (rows, stdout). A run
    past DRY_RUN_TIMEOUT_S fails the test with its output (and, from faulthandler, its threads' stacks)."""
    from tests.conftest import child_xla_flags

    rows_file = out / "rows.json"
    dump_after = max(1, DRY_RUN_TIMEOUT_S - 30)  # before the kill, so that the stacks come back
    code = _DRY_RUN.format(dump_after=dump_after, benchmarks=str(SCRIPT.parent), rows=str(rows_file))
    env = dict(os.environ, XLA_FLAGS=child_xla_flags(1),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    try:
        result = subprocess.run([sys.executable, "-c", code, *argv, "--out", str(out)], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x
                         for x in (err.stdout or "", err.stderr or ""))
        pytest.fail(f"bench_train.py {' '.join(argv)} ran past {DRY_RUN_TIMEOUT_S} s (killed); its output:\n"
                    f"{output[-6000:]}")
    hung = "Timeout (" in result.stderr  # faulthandler's header
    why = f"ran past {dump_after} s; faulthandler's stacks follow" if hung else "its output follows"
    assert result.returncode == 0, (f"bench_train.py {' '.join(argv)} exited with {result.returncode} ({why}):\n"
                                    + result.stdout[-3000:] + result.stderr[-6000:])
    return json.loads(rows_file.read_text()), result.stdout


def test_dry_run_jax_row_runs_the_torch_rows_model_and_prints_the_ratio(tmp_path):
    """--frameworks torch jax: the jax-1gpu row (float32 on the CPU, the layers' jnp paths) after the torch
    row, with the torch model's weights, documents and tokens, so both steps give the same loss."""
    step = _load_jax_step()
    rows, out = dry_run_in_subprocess(["--dry-run", "--gpus", "1", "--frameworks", "torch", "jax"], tmp_path)
    assert [(row["framework"], row["variant"]) for row in rows] == [("torch", "cp_linear-1gpu"), ("jax", "jax-1gpu")]
    torch_row, jax_row = rows
    assert 0 < jax_row["step_ms"] < 60e3, jax_row
    assert jax_row["tokens_per_s"] == pytest.approx(TOKENS / (jax_row["step_ms"] / 1e3), rel=1e-9)
    assert math.isnan(jax_row["mfu"]) and math.isnan(jax_row["peak_gib"]), jax_row  # no GPU: not measured
    assert jax_row["kernels"] == {"GDP": 0, "short conv": 0, "gated norm": 0, "cuDNN attention": 0}  # CPU: jnp paths
    # both float32 here: the converted weights, same tokens and documents give the torch loss to rounding
    assert jax_row["loss"] == pytest.approx(torch_row["loss"], rel=1e-5)

    with open(tmp_path / "bench_train.csv") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == COLUMNS
        assert [(r["framework"], r["variant"]) for r in reader] == [("torch", "cp_linear-1gpu"), ("jax", "jax-1gpu")]
    ratio = jax_row["tokens_per_s"] / torch_row["tokens_per_s"]
    assert f"jax / torch tokens/s: jax-1gpu / cp_linear-1gpu = {ratio:.3f}" in out
    kernels = step.kernel_summary(jax_row["kernels"])
    assert f"kernels in the step: {kernels}" in out
    assert "none (the kernels need a CUDA GPU" in kernels or step.backend() != "cpu"  # a GPU machine: "no (jnp ops)"
    assert "peak memory: not reported (memory_stats() is None on cpu)" in out
    assert "failed" not in out


@pytest.mark.parametrize("argv, expected", [
    pytest.param(["--dry-run"], False, id="dry-run-default-torch-only"),
    pytest.param([], True, id="default-jax-when-importable"),
    pytest.param(["--frameworks", "torch"], False, id="torch"),
    pytest.param(["--dry-run", "--frameworks", "jax"], True, id="dry-run-jax"),
])
def test_frameworks_choose_the_jax_row(argv, expected):
    pytest.importorskip("jax")  # the default looks for an importable jax
    bench = _load()
    args = argparse.Namespace(dry_run="--dry-run" in argv,
                              frameworks=argv[argv.index("--frameworks") + 1:] if "--frameworks" in argv else None)
    assert bench.wants_jax(args) is expected


def test_kernel_use_counts_custom_calls_by_family():
    """The kernel record reads the lowered step: each family's cp_linear custom calls (the column sum
    serves the conv's and the norm's weight gradients alike and counts for neither) and cuDNN's attention."""
    step = _load_jax_step()
    text = "\n".join(f"%{i} = stablehlo.custom_call @cp_linear_{name}_bfloat16_K_128(%arg0)" for i, name in enumerate([
        "ChunkPrepConfig", "ChunkScanConfig", "SegmentFoldConfig", "ChunkReverseScanConfig", "ChunkPrepBackwardConfig",
        "ShortConvConfig", "ShortConvBackwardConfig", "GatedRMSNormBackwardConfig", "ColumnSumConfig"]))
    text += ('\n%9 = stablehlo.custom_call @"__cudnn$fmhaSoftmax"(%arg0)'
             '\n%10 = stablehlo.custom_call @"__cudnn$fmhaSoftmaxBackward"(%9)')
    assert step.kernel_use(text) == {"GDP": 5, "short conv": 2, "gated norm": 1, "cuDNN attention": 2}
    assert step.kernel_use("stablehlo.custom_call @Sharding(%arg0)") == {"GDP": 0, "short conv": 0, "gated norm": 0,
                                                                        "cuDNN attention": 0}


def _fla_baseline():
    _load()  # puts benchmarks/ on the path
    return importlib.import_module("fla_baseline")


def test_fla_row_prints_its_note_and_the_speedup_and_keeps_the_csv_columns(tmp_path, capsys):
    bench = _load()
    row = dict(framework="torch", gpus=1, tokens_per_gpu=TOKENS, step_ms=1.0, mfu=0.5, peak_gib=1.0)
    rows = [dict(row, variant="cp_linear-1gpu", tokens_per_s=3000.0),
            dict(row, variant="fla-1gpu", tokens_per_s=2000.0, note="guard switched off: timing only")]
    bench.write(rows, str(tmp_path))
    with open(tmp_path / "bench_train.csv") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == COLUMNS
        assert [r["variant"] for r in reader] == ["cp_linear-1gpu", "fla-1gpu"]
    out = capsys.readouterr().out
    assert "fla-1gpu: guard switched off: timing only" in out
    assert "speedup: cp_linear-1gpu / fla-1gpu tokens/s = 1.50x" in out
    assert bench.speedup(rows[:1]) is None


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager, on the CPU
def test_fla_baseline_attention_matches_ours_on_cpu():
    """The baseline's flex_attention under the document-causal BlockMask (eager, forward) gives our
    BlockDiagAttention's output: same projections, RoPE positions and documents."""
    import numpy as np
    import torch

    from cp_linear.model_config import DecoderConfig
    from torch_api.layers import BlockDiagAttention, build_shard_layout

    baseline = _fla_baseline()
    config = DecoderConfig(**_load().TINY).attention_config()
    torch.manual_seed(0)
    ours = BlockDiagAttention(config)
    ids = np.repeat([1, 2, 3], [13, 40, 22])  # 75 tokens: documents across and inside flex's 128 blocks
    layout = build_shard_layout(total_len=ids.size, doc_ids=ids)
    x = torch.randn(1, ids.size, config.hidden_size)
    with torch.no_grad():  # flex_attention has no CPU backward
        expected = ours(x, layout=layout)
        received = baseline.FlexDocAttention(ours)(x, layout=baseline.FlexLayout(layout, torch.device("cpu")))
    torch.testing.assert_close(received, expected, rtol=1e-5, atol=1e-6)


def test_fla_decoder_has_our_parameters_and_weights():
    """The FLA variant at the tiny size: FLA's GatedDeltaProduct in every GDP block, holding our layer's
    weights (the strict load in fla_decoder checks names and shapes), and the same parameter count."""
    pytest.importorskip("fla.layers")  # flash-linear-attention is not a dependency: skipped without it
    import torch
    from fla.layers import GatedDeltaProduct as FLAGatedDeltaProduct

    from cp_linear.model_config import DecoderConfig
    from torch_api.layers import HybridDecoder

    baseline = _fla_baseline()
    config = DecoderConfig(**_load().TINY)
    torch.manual_seed(0)
    ours = HybridDecoder(config)
    torch.manual_seed(0)
    fla_model = baseline.fla_decoder(config)
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    assert count(fla_model) == count(ours)
    for index, kind in enumerate(config.layer_types):
        mixer, our_mixer = fla_model.layers[index].attn, ours.layers[index].attn
        if kind == "gdp":
            assert isinstance(mixer.fla, FLAGatedDeltaProduct)
            received, expected = mixer.fla.state_dict(), our_mixer.state_dict()
        else:
            assert isinstance(mixer, baseline.FlexDocAttention)
            received, expected = mixer.state_dict(), our_mixer.state_dict()
        assert list(received) == list(expected)
        for name in expected:
            torch.testing.assert_close(received[name], expected[name], rtol=0, atol=0)
    # embedding, norms, MLPs and head are ours, with our initial weights
    torch.testing.assert_close(fla_model.lm_head.weight, ours.lm_head.weight, rtol=0, atol=0)
    assert baseline.bypass_fla_hopper_guard() is False  # no Hopper here: nothing to bypass
