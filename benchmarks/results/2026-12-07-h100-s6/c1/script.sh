#!/bin/bash
# session 2026-12-07 (sixth), call 1: the poison folded into the contained output scan and the dO loads; any_flagged
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
ROOT=$(pwd)
export PYTHONPATH=$ROOT:${PYTHONPATH:-}
nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt
python3 -m cp_linear.kernels --compile --library /tmp/kernel_lib --jobs 15 --dtype bfloat16 > $OUT/compile.log 2>&1
tail -1 $OUT/compile.log
export CP_LINEAR_KERNEL_LIBRARY=/tmp/kernel_lib
timeout 150 python3 -m pytest -q -m gpu tests/jax_api/test_cutedsl_gpu.py -k "contained or (one_device_op and default and not fp16)" -p no:cacheprovider > $OUT/pytest_jax.log 2>&1
tail -3 $OUT/pytest_jax.log
mkdir -p $OUT/bench_jax_1
timeout 200 python3 benchmarks/bench_jax_kernels.py --repeat 20 --cases 1x32768:2 1x131072:2 --kernels --out $OUT/bench_jax_1 > $OUT/jaxk_1.log 2>&1
grep -E "^case|jax fwd|torch fwd" $OUT/jaxk_1.log | cut -c1-420
