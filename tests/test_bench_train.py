"""benchmarks/bench_train.py imports without a GPU and its --dry-run (tiny model, CPU, gloo for CP)
runs end to end, so the script cannot rot between GPU sessions."""

import csv
import importlib
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py"


def _load():
    """Imported by name (the CP run spawns processes, which import the module again)."""
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    return importlib.import_module("bench_train")


@pytest.mark.timeout(300)
def test_dry_run_writes_a_row_per_world_size(tmp_path):
    bench = _load()
    rows = bench.main(["--dry-run", "--gpus", "1", "2", "--out", str(tmp_path), "--timeout", "120"])
    assert [row["gpus"] for row in rows] == [1, 2]
    assert all(row["tokens_per_s"] > 0 for row in rows)
    with open(tmp_path / "bench_train.csv") as handle:
        assert len(list(csv.DictReader(handle))) == 2
