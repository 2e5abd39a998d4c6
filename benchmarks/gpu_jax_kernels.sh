#!/usr/bin/env bash
# One GPU call: JAX on the CuTeDSL kernels. The GPU tests (JAX vs torch bit for bit on 1 GPU, and on
# 2 when two are visible), then JAX vs torch wall time at bench_gdp_fwd.py's shapes (and the JAX CP
# op on 2 GPUs with the torch NCCL CP forward beside it). Logs go to $OUT (or out/gpu_jax_kernels).
#   source .gpuwheels/b/install.sh && bash benchmarks/gpu_jax_kernels.sh
# Env: NO_TESTS=1 / NO_BENCH=1 skip a part; BENCH_CASES="1x8192:2 ..." picks the timed cases;
# PYTEST_K="expr" selects tests. Kernels missing from the prebuilt library (.kernel_lib, carried)
# are compiled first, in parallel: the bfloat16 ones and the float16 K = 64 ones the tests use
# (FULL_COMPILE=1: all). Both parts together may pass the 10-minute limit of one call: on a fresh
# machine run NO_BENCH=1 first, then NO_TESTS=1 on the same warm machine (library already built).
set -uo pipefail
out=${OUT:-out/gpu_jax_kernels}
mkdir -p "$out" .kernel_lib
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export CP_LINEAR_KERNEL_LIBRARY=$PWD/.kernel_lib
gpus=$(nvidia-smi -L | tee "$out/gpu.log" | wc -l)
python3 -c "import jax, jax_tvm_ffi, cutlass, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__)" \
  2>&1 | tail -2 | tee "$out/versions.log"
# bfloat16 kernels, plus the float16 K = 64 ones of the fp16 test case (FULL_COMPILE=1: every config)
if [ -n "${FULL_COMPILE:-}" ]; then
  timeout 300 python3 -m cp_linear.kernels --compile --library .kernel_lib --jobs 16 2>&1 | tail -3 | tee "$out/compile.log"
else
  timeout 200 python3 -m cp_linear.kernels --compile --library .kernel_lib --jobs 16 --dtype bfloat16 2>&1 \
    | tail -3 | tee "$out/compile.log"
  timeout 100 python3 -m cp_linear.kernels --compile --library .kernel_lib --jobs 16 --only "(float16, K=64" 2>&1 \
    | tail -3 | tee -a "$out/compile.log"
fi
if [ -z "${NO_TESTS:-}" ]; then
  timeout 280 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/jax_api/test_cutedsl_gpu.py \
    ${PYTEST_K:+-k "$PYTEST_K"} > "$out/pytest_jax_gpu.log" 2>&1
  echo "=== pytest exit $?"
  grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed" "$out/pytest_jax_gpu.log" | tail -25
fi
if [ -z "${NO_BENCH:-}" ]; then
  cases=${BENCH_CASES:-"1x8192:2 1x32768:2 1x131072:2 1x32768:1 32x1024:2"}
  cp_flag=""; [ "$gpus" -ge 2 ] && cp_flag="--cp"
  timeout 300 python3 benchmarks/bench_jax_kernels.py --out "$out" --repeat 10 --cases $cases $cp_flag 2>&1 \
    | tee "$out/bench.log"
  if [ "$gpus" -ge 2 ]; then
    timeout 130 python3 benchmarks/cp_gdp_nccl.py --tokens 65536 --timeout 120 2>&1 | tee "$out/cp_nccl.log"
  fi
fi
