#!/bin/bash
# session 2026-12-08, call 1: the output scan's epilogue through shared memory (old = HEAD 49fd22b, new = tree)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
NEW=$(pwd); OLD=$NEW/scratch/old; BASE=${PYTHONPATH:-}
nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt
(cd $OLD && PYTHONPATH=$OLD:$BASE python3 -m cp_linear.kernels --compile --library /tmp/lib_old --jobs 8 --dtype bfloat16 > $OUT/compile_old.log 2>&1) &
PYTHONPATH=$NEW:$BASE python3 -m cp_linear.kernels --compile --library /tmp/lib_new --jobs 8 --dtype bfloat16 > $OUT/compile_new.log 2>&1
wait
tail -1 $OUT/compile_old.log; tail -1 $OUT/compile_new.log
run_in() {  # run_in old|new CMD...: in that tree with its library
  local tree=$NEW; [ "$1" = old ] && tree=$OLD
  local lib=/tmp/lib_$1; shift
  (cd $tree && PYTHONPATH=$tree:$BASE CP_LINEAR_KERNEL_LIBRARY=$lib "$@")
}
export PYTHONPATH=$NEW:$BASE CP_LINEAR_KERNEL_LIBRARY=/tmp/lib_new
timeout 150 python3 -m pytest -q -m gpu tests/torch_api/test_cutedsl_backend.py -x -p no:cacheprovider \
  -k "float64_recurrence or emulation or repeatable or compose or long_packed or contained or flash_linear" > $OUT/pytest_torch.log 2>&1
tail -3 $OUT/pytest_torch.log
timeout 120 python3 -m pytest -q -m gpu tests/jax_api/test_cutedsl_gpu.py -x -p no:cacheprovider \
  -k "contained or (one_device_op and not fp16)" > $OUT/pytest_jax.log 2>&1
tail -3 $OUT/pytest_jax.log
for t in new old new old; do
  echo "== probe $t"; run_in $t timeout 100 python3 $NEW/scratch/scan_probe.py --only ABC > $OUT/probe_$t.log 2>&1
  grep -E "^round [12]|bits" $OUT/probe_$t.log | tail -7 >> $OUT/probe_summary.txt; grep -E "^round 2" $OUT/probe_$t.log
done
for t in new old; do
  echo "== fwd $t"; run_in $t timeout 90 python3 benchmarks/bench_gdp_fwd.py --no-fla --cases 1x8192:2 1x32768:2 32x1024:2 \
    --out $OUT/fwd_$t > $OUT/fwd_$t.log 2>&1; grep -E "default" $OUT/fwd_$t.log | grep -v ":.*kernel_cutlass" | head -4; grep -E "default:" $OUT/fwd_$t.log | cut -c1-200
done
timeout 150 python3 benchmarks/bench_jax_kernels.py --repeat 20 --cases 1x131072:2 1x32768:2 --cuda-graph --out $OUT/jg > $OUT/jax_graph.log 2>&1
grep -E "^case|fwd:|fwd\+bwd:" $OUT/jax_graph.log | cut -c1-300
