#!/usr/bin/env bash
# One device call (nvidia-h200-x2): the fault suite over NCCL on 2 GPUs, then its JAX and one-device
# cases on the same machine. Needs only array-api-compat carried in .whl/ (if the image lacks it).
# Logs go to $OUT (gpu_fault_suite.log).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi -L
timeout 900 python3 benchmarks/gpu_fault_suite.py --out "${OUT:-out}"
echo "=== gpu_fault_suite exit $?"
