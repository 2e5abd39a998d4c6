#!/usr/bin/env bash
# One device call (nvidia-h200-x2): both training examples with CP over 2 GPUs (NCCL / jax GPUs),
# scaled up from the CPU defaults. Needs only array-api-compat carried in .whl/. Logs go to $OUT.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
step() { local limit=$1 name=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "=== $name exit $?"; tail -n 6 "$OUT/$name.log" | tr '\r' '\n' | tail -n 6; }
step 120 train_torch python3 -m examples.train_torch --device cuda --cp 2 --steps 150 --seq-len 8192 --layers 4 \
  --hidden 256 --heads 4 --head-dim 64 --dtype bfloat16 --out "$OUT/torch"
step 120 train_jax python3 -m examples.train_jax --device gpu --cp 2 --steps 150 --seq-len 8192 --layers 4 \
  --hidden 256 --heads 4 --head-dim 64 --out "$OUT/jax"
