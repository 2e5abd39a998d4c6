#!/bin/bash
# session 2026-12-07 (seventh), call 2: JAX vs torch (torch's contained op now on the flags route) at 131k and 32k
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
cd scratch/clean; ROOT=$(pwd)
export PYTHONPATH=$ROOT:${PYTHONPATH:-}
nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt
python3 -m cp_linear.kernels --compile --library /tmp/kernel_lib --jobs 16 --dtype bfloat16 > $OUT/compile.log 2>&1
tail -1 $OUT/compile.log
export CP_LINEAR_KERNEL_LIBRARY=/tmp/kernel_lib
timeout 170 python3 benchmarks/bench_jax_kernels.py --repeat 20 --cases 1x131072:2 --kernels --out $OUT/b131 > $OUT/jaxk_131.log 2>&1
grep -E "^case|fwd:|fwd\+bwd:" $OUT/jaxk_131.log | cut -c1-330
timeout 120 python3 benchmarks/bench_jax_kernels.py --repeat 20 --cases 1x32768:2 --out $OUT/b32 > $OUT/jaxk_32.log 2>&1
grep -E "^case" $OUT/jaxk_32.log
