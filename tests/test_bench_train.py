"""benchmarks/bench_train.py imports without a GPU and its --dry-run (tiny model on the CPU, gloo for
CP) runs end to end and writes its table and CSV, so the script cannot rot between GPU sessions.

The CP rank runs in the session's 2-rank gloo pool instead of freshly spawned processes (spawning
two ranks that import torch cost most of the old test's 150 s on CI); ``run_world``'s spawning is
the only part left to the GPU sessions.
"""

import csv
import importlib
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py"
TOKENS = 32  # --dry-run's tokens per rank
COLUMNS = ["framework", "variant", "gpus", "tokens_per_gpu", "step_ms", "tokens_per_s", "mfu", "peak_gib"]


def _load():
    """Imported by name, in the test process and in the pool's workers."""
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    return importlib.import_module("bench_train")


def measure_in_pool(rank, world, args):
    return _load().measure(rank, world, dist.group.WORLD, args)


@pytest.mark.multirank
def test_dry_run_prints_and_writes_a_row_per_world_size(tmp_path, gloo_pools, capsys):
    bench = _load()

    def run(world, args):
        if world == 1:
            return [bench.measure(0, 1, None, args)]
        return [row for row in gloo_pools(world).run(measure_in_pool, args) if row is not None]

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
