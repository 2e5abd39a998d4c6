"""``_mma.stage_accumulator_stmatrix`` writes every accumulator element where ``stage_accumulator`` does
(CPU only: CuTe layouts evaluated while tracing, stmatrix emulated from the PTX ISA).

For each MMA family and shape the chunk scan stages its state with and the reverse scan its gradient rows
(``mma.sync`` over 4 or 8 warps, warpgroup MMA over 1 or 2 warpgroups; K = 64, 128) and the staging
tile's layout
(``smem_tile_layout``, (3, 3, 3)-swizzled rows of 64):

* reference: thread t's element e (``acc[e]``) goes to ``layout(coords[e])``, coords the MMA's C
  partition of an identity tensor (what ``stage_accumulator`` does);
* stmatrix: the helper's own partitions (``stmatrix_c_partitions``, of the accumulator and of an
  identity view) give, per thread and per instruction, which accumulator element feeds each of its 8
  source values and the 8 destination coordinates of its row address;
  the warp instruction is then emulated as the PTX ISA documents ``stmatrix.sync.aligned.m8n8.x4.b16``:
  register q (source values 2q, 2q + 1) of lane l holds row l / 4, columns 2 (l % 4) + {0, 1} of matrix
  q, and lane 8 q + r gives the address of row r of matrix q (8 contiguous 16-bit elements).

Both must write the same (thread, element) at every offset of the tile, each offset exactly once. Also
checked: the 8 row addresses of each matrix fall in 8 distinct 16-byte bank groups (one shared-memory
wavefront per matrix, no bank conflicts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# "wgmma": B MN-major (chunk_scan's state product); "wgmma_k": B K-major (the reverse scan's gradient)
CASES = [("sync", 4, 64), ("sync", 4, 128), ("sync", 8, 64), ("sync", 8, 128),
         ("wgmma", 1, 64), ("wgmma", 1, 128), ("wgmma", 2, 64), ("wgmma", 2, 128),
         ("wgmma_k", 1, 64), ("wgmma_k", 1, 128)]


def _trace_mappings(kind: str, units: int, key_dim: int, dtype_name: str = "bfloat16"):
    """(reference, stmatrix): dicts offset -> (thread, element index) for one case."""
    import cutlass
    import cutlass.cute as cute

    from cp_linear.kernels import _mma

    dtype = getattr(cutlass, {"bfloat16": "BFloat16", "float16": "Float16"}[dtype_name])
    rows = 16 * units if kind == "sync" else 64 * units
    threads = 32 * units if kind == "sync" else 128 * units
    out: dict = {}

    def collect():  # a plain function, run while tracing: its loops and checks are Python's
        if kind == "sync":
            tiled_mma = _mma.make_tiled_mma(dtype, units)
        else:
            tiled_mma = _mma.make_wgmma(dtype, units, key_dim, b_mn_major=kind == "wgmma")
        layout = _mma.smem_tile_layout(rows, key_dim)
        tiled_copy = _mma.make_stmatrix_copy_c(tiled_mma, dtype)
        identity = cute.make_identity_tensor((rows, key_dim))
        reference, emulated = {}, {}
        for t in range(threads):
            thr = tiled_mma.get_slice(t)
            acc = cute.make_rmem_tensor(thr.partition_shape_C((rows, key_dim)), cutlass.Float32)
            coords = thr.partition_C(identity)
            for e in range(cute.size(acc)):
                offset = cute.crd2idx(coords[e], layout)
                assert offset not in reference, (t, e, offset)
                reference[offset] = (t, e)
        # register offset -> element index (the accumulator's layout is compact)
        acc0 = cute.make_rmem_tensor(tiled_mma.get_slice(0).partition_shape_C((rows, key_dim)), cutlass.Float32)
        element_of = {acc0.layout(e): e for e in range(cute.size(acc0))}
        assert sorted(element_of) == list(range(cute.size(acc0)))
        sources, addresses = [], []
        for t in range(threads):
            thr_copy = tiled_copy.get_slice(t)
            # the helper's grouping: ((an instruction's 8 values, repeats), M, N) partitions
            assert cute.size(thr_copy.retile(acc0).shape[0][0]) == 8
            assert cute.size(thr_copy.partition_D(identity).shape[0][0]) == 8
            # the helper's own partitions, of the accumulator and of an identity view (coordinates)
            src, dst = _mma.stmatrix_c_partitions(tiled_copy, t, acc0, identity)
            calls = cute.size(dst, mode=[1])
            assert cute.size(src, mode=[0]) == cute.size(dst, mode=[0]) == 8 and cute.size(src, mode=[1]) == calls
            assert 8 * calls == cute.size(acc0)
            sources.append([[element_of[src.layout((v, j))] for v in range(8)] for j in range(calls)])
            rows_at = []
            for j in range(calls):
                run = [cute.crd2idx(dst[v, j], layout) for v in range(8)]
                # one stmatrix row address: 8 contiguous elements, 16-byte aligned
                assert run == list(range(run[0], run[0] + 8)) and run[0] % 8 == 0, (t, j, run)
                rows_at.append(run[0])
            addresses.append(rows_at)
        for warp in range(threads // 32):  # each matrix's 8 rows in 8 distinct 16-byte bank groups
            for j in range(len(addresses[0])):
                for q in range(4):
                    groups = {(2 * addresses[32 * warp + 8 * q + r][j] // 16) % 8 for r in range(8)}
                    assert len(groups) == 8, (warp, j, q, groups)
        for t in range(threads):
            warp, lane = divmod(t, 32)
            for j, values in enumerate(sources[t]):
                for v, e in enumerate(values):
                    matrix, half = divmod(v, 2)
                    row_lane = 32 * warp + 8 * matrix + lane // 4
                    offset = addresses[row_lane][j] + 2 * (lane % 4) + half
                    assert offset not in emulated, (t, j, v, offset)
                    emulated[offset] = (t, e)
        out["reference"], out["emulated"] = reference, emulated

    @cute.jit
    def trace():
        collect()

    cute.compile(trace)
    return out["reference"], out["emulated"], rows


def _check(kind: str, units: int, key_dim: int) -> str:
    reference, emulated, rows = _trace_mappings(kind, units, key_dim)
    if sorted(reference) != list(range(rows * key_dim)):
        return "the reference does not cover the tile"
    if emulated != reference:
        wrong = sorted(offset for offset in reference if emulated.get(offset) != reference[offset])
        return f"{len(wrong)} offsets differ, first {wrong[0]}: {emulated.get(wrong[0])} != {reference[wrong[0]]}"
    return "ok"


@pytest.fixture(scope="module")
def verdicts() -> dict:
    """Every case traced in one fresh process for sm_90a (the DSL reads CUTE_DSL_ARCH once, and
    warpgroup MMAs exist only there)."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (the cuda extra)")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=1500, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind,units,key_dim", CASES)
def test_stmatrix_staging_writes_what_stage_accumulator_writes(verdicts, kind, units, key_dim):
    assert verdicts[f"{kind}-{units}-{key_dim}"] == "ok"


if __name__ == "__main__":  # the fixture's process: one JSON line {case: "ok" or what failed}
    found = {}
    for case in CASES:
        try:
            found["-".join(map(str, case))] = _check(*case)
        except AssertionError as err:
            found["-".join(map(str, case))] = f"assertion failed: {err}"
    print(json.dumps(found))
