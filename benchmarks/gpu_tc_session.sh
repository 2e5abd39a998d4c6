#!/usr/bin/env bash
# One GPU call: the tensor-core kernels checked stage by stage, benchmarked against FLA,
# then (with 2 GPUs) the CP forward over NCCL. Logs go to $OUT (or out/gpu_tc_session).
#   source .gpuwheels/b/install.sh && bash benchmarks/gpu_tc_session.sh [CHECK_ARGS...]
# Switches: PYTEST=1 (GPU tests, PYTEST_K=expr), NO_CHECK=1, NO_BENCH=1, BENCH_VARIANTS="default wg ...",
# BENCH_CASES="1x32768:2 ...", TRAIN=1 (forward + backward vs FLA, TRAIN_TOKENS="8192 32768"), NCU=1
# (NCU_TRAIN=1: a forward + backward step; NCU_REGEX, NCU_SKIP, NCU_COUNT pick the launches).
# Kernels missing from the prebuilt library (.kernel_lib, carried) are compiled first, in parallel.
set -uo pipefail
out=${OUT:-out/gpu_tc_session}
mkdir -p "$out" .kernel_lib
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export CP_LINEAR_KERNEL_LIBRARY=$PWD/.kernel_lib
nvidia-smi -L | tee "$out/gpu.log"
# seen once: array_api_compat missing from the wheel directory after a reinstall; put it back when carried
if ! python3 -c "import array_api_compat" 2>/dev/null && ls .gpuwheels/b/array_api_compat-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target "$HOME/gpusite" .gpuwheels/b/array_api_compat-*.whl
fi
only_bf16="--dtype bfloat16"  # the float16 kernels compile on first use (FULL_COMPILE=1: all now)
[ -n "${FULL_COMPILE:-}" ] && only_bf16=""
timeout 300 python3 -m cp_linear.kernels --compile --library .kernel_lib --jobs 16 $only_bf16 2>&1 | tail -3 | tee "$out/compile.log"
if [ -n "${PYTEST:-}" ]; then
  timeout 240 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/torch_api/test_cutedsl_backend.py ${PYTEST_K:+-k "$PYTEST_K"} > "$out/pytest_gpu.log" 2>&1
  tail -5 "$out/pytest_gpu.log"
fi
if [ -z "${NO_CHECK:-}" ]; then
  timeout 240 python3 benchmarks/check_tc_kernels.py "$@" 2>&1 | tee "$out/check.log"
fi
cases=${BENCH_CASES:-"1x8192:2 1x32768:2 1x131072:2 1x32768:1 32x1024:2"}
variants=${BENCH_VARIANTS:-"default"}
[ -z "${NO_BENCH:-}" ] && timeout 300 python3 benchmarks/bench_gdp_fwd.py --out "$out" --repeat 10 --cases $cases --variants $variants 2>&1 | tee "$out/bench.log"
if [ -n "${TRAIN:-}" ]; then
  timeout 300 python3 benchmarks/bench_gdp_train.py --out "$out/train" --tokens ${TRAIN_TOKENS:-8192 32768} ${TRAIN_ARGS:-} 2>&1 | tee "$out/train.log"
fi
if [ -n "${NCU:-}" ]; then
  # NCU_TRAIN=1 profiles a forward + backward step (bench_gdp_train), else the forward alone
  ncu_run="python3 benchmarks/bench_gdp_fwd.py --out $out/ncu --repeat 1 --no-fla --cases 1x32768:2"
  [ -n "${NCU_TRAIN:-}" ] && ncu_run="python3 benchmarks/bench_gdp_train.py --out $out/ncu --tokens 32768 --repeat 1 --no-fla --no-torch-backward"
  timeout 200 ncu --kernel-name regex:"${NCU_REGEX:-ChunkScan|ChunkPrep|SegmentFold}" --launch-skip ${NCU_SKIP:-4} \
    --launch-count ${NCU_COUNT:-4} \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --clock-control none \
    bash -c "export PYTHONPATH=$PYTHONPATH CP_LINEAR_KERNEL_LIBRARY=$CP_LINEAR_KERNEL_LIBRARY; $ncu_run" > "$out/ncu.log" 2>&1
  # (ncu does not pass PYTHONPATH on to the profiled process: hence the bash -c)
fi
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 250 python3 benchmarks/cp_gdp_nccl.py --tokens 65536 --timeout 240 --backward 2>&1 | tee "$out/cp_nccl.log"
fi
