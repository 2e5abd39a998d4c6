#!/bin/bash
# session 2026-12-07 (seventh), call 1: why JAX's contained output scan is slower than torch's at 131k
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
ROOT=$(pwd)
export PYTHONPATH=$ROOT:${PYTHONPATH:-}
nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt
python3 -m cp_linear.kernels --compile --library /tmp/kernel_lib --jobs 15 --dtype bfloat16 > $OUT/compile.log 2>&1
tail -1 $OUT/compile.log
export CP_LINEAR_KERNEL_LIBRARY=/tmp/kernel_lib
(while true; do nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active --format=csv,noheader >> $OUT/clocks.txt; sleep 2; done) &
CLK=$!
timeout 240 python3 scratch/scan_probe.py > $OUT/probe.log 2>&1; tail -14 $OUT/probe.log
kill $CLK
timeout 240 ncu --profile-from-start off --kernel-name regex:"chunk_scan|chunk_prep" \
  --section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats \
  --csv --page details python3 scratch/scan_probe.py --ncu --only ABC > $OUT/ncu.csv 2> $OUT/ncu.err
tail -3 $OUT/ncu.err; wc -l $OUT/ncu.csv
python3 - <<'PY'
import csv, os, collections
rows = list(csv.reader(open(os.environ["OUT"] + "/ncu.csv")))
head = [i for i, r in enumerate(rows) if r and r[0] == "ID"]
if head:
    h = rows[head[0]]
    want = ("Duration", "Grid Size", "Block Size", "Registers Per Thread", "Achieved Occupancy",
            "Dynamic Shared Memory Per Block", "Memory Throughput", "Compute (SM) Throughput", "Waves Per SM",
            "Warp Cycles Per Issued Instruction")
    table = collections.OrderedDict()
    for r in rows[head[0] + 1:]:
        d = dict(zip(h, r))
        if d.get("Metric Name") in want:
            table.setdefault((d["ID"], d["Kernel Name"][38:80]), {})[d["Metric Name"]] = d["Metric Value"]
    for key, m in table.items():
        print(key, " | ".join(f"{n.split()[0]}={m.get(n, '')}" for n in want))
PY
timeout 200 python3 -m pytest -q -m gpu tests/jax_api/test_cutedsl_gpu.py -k "contained or (one_device_op and default and not fp16)" -p no:cacheprovider > $OUT/pytest_jax.log 2>&1
tail -3 $OUT/pytest_jax.log
timeout 200 python3 -m pytest -q -m gpu tests/torch_api/test_cutedsl_backend.py -k "contained or never_waits" -p no:cacheprovider > $OUT/pytest_torch.log 2>&1
tail -3 $OUT/pytest_torch.log
