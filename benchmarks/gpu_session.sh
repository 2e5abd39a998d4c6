#!/usr/bin/env bash
# One device call (nvidia-h200-x2) that checks the pure torch / JAX paths on real GPUs; needs no
# CuTeDSL wheels, only array-api-compat carried in .whl/. Logs go to $OUT.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
step() { local limit=$1 name=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v '^\[ok\]'; echo "=== $name exit ${PIPESTATUS[0]}"; }
step 110 torch_cp python3 benchmarks/gpu_torch_cp_check.py --timeout 100
step 100 jax_check python3 benchmarks/gpu_jax_check.py
step 60 pytest_gpu python3 -m pytest -q -p no:cacheprovider -m gpu tests/torch_api/test_gdp_chunk.py
step 170 bench_blockdiag python3 benchmarks/bench_blockdiag.py --budget-s 150 --reserve-s 10 --max-world 2
