#!/usr/bin/env bash
# Nsight Compute metrics for the kernels of a few decode forwards (the NVTX "forward" ranges).
# Clocks are left as the GPU runs them (--clock-control none), so the figures match the bench.
#   perf/ncu_kernels.sh                          # bench latency, short, default model
#   LAUNCH_COUNT=200 perf/ncu_kernels.sh latency --device cuda --model /path/to/model
# Writes $OUT/ncu_kernels.ncu-rep and a CSV of the basic set ($OUT defaults to ./perf_out).
set -euo pipefail
OUT=${OUT:-perf_out}
LAUNCH_SKIP=${LAUNCH_SKIP:-200}    # skip warm-up and prefill kernels
LAUNCH_COUNT=${LAUNCH_COUNT:-100}  # about one decode step of a small model
if ! command -v ncu >/dev/null; then
  echo "error: ncu (Nsight Compute) is not on PATH; install it with the CUDA toolkit" >&2
  exit 2
fi
mkdir -p "$OUT"
if [ $# -eq 0 ]; then
  set -- latency --device cuda --prompt-len 128 --output-len 16 --repeats 1
fi
export COMPILED_ENGINE_NVTX=1
ncu --force-overwrite --clock-control none --set basic --nvtx --nvtx-include "forward/" \
  --launch-skip "$LAUNCH_SKIP" --launch-count "$LAUNCH_COUNT" \
  --export "$OUT/ncu_kernels" python3 -m compiled_engine.bench "$@"
ncu --import "$OUT/ncu_kernels.ncu-rep" --csv --page raw > "$OUT/ncu_kernels.csv"
echo "report: $OUT/ncu_kernels.ncu-rep; metrics: $OUT/ncu_kernels.csv"
