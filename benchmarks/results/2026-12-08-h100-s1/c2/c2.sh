#!/bin/bash
# session 2026-12-08, call 2: the model step (flags route, new epilogue); ncu of the new output scans; torch.compile retry
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
NEW=$(pwd)
export PYTHONPATH=$NEW:${PYTHONPATH:-}
nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt
if [ ! -d /tmp/lib_new ]; then
  python3 -m cp_linear.kernels --compile --library /tmp/lib_new --jobs 16 --dtype bfloat16 > $OUT/compile_new.log 2>&1
  tail -1 $OUT/compile_new.log
fi
export CP_LINEAR_KERNEL_LIBRARY=/tmp/lib_new
for g in "" "--cuda-graph"; do
timeout 150 python3 benchmarks/bench_jax_kernels.py --repeat 20 --cases 1x131072:2 1x32768:2 $g --out $OUT/j$g > $OUT/jax$g.log 2>&1
grep -E "^case" $OUT/jax$g.log | cut -c1-420
done
timeout 200 python3 benchmarks/bench_train.py --gpus 1 --tokens 32768 --repeat 5 --warmup 2 --no-fla \
  --frameworks torch jax --out $OUT/train > $OUT/train.log 2>&1
grep -E "ms|tokens/s" $OUT/train.log | tail -6
