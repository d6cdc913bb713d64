#!/usr/bin/env bash
# Nsight Systems timeline of a bench run, with NVTX ranges around each engine step's phases
# (schedule, prepare inputs, forward, sample, detokenize).
#   perf/nsys_profile.sh                         # bench latency, short, default model
#   perf/nsys_profile.sh offline --num-seqs 64 --input-len 128 512 --output-len 64 128
# Writes $OUT/nsys_profile.nsys-rep and a kernel/NVTX summary ($OUT defaults to ./perf_out).
set -euo pipefail
OUT=${OUT:-perf_out}
if ! command -v nsys >/dev/null; then
  echo "error: nsys (Nsight Systems) is not on PATH; install it with the CUDA toolkit" >&2
  exit 2
fi
mkdir -p "$OUT"
if [ $# -eq 0 ]; then
  set -- latency --device cuda --prompt-len 512 --output-len 64 --repeats 1
fi
export COMPILED_ENGINE_NVTX=1
nsys profile --force-overwrite true --trace cuda,nvtx,osrt --cuda-graph-trace node \
  --output "$OUT/nsys_profile" python3 -m compiled_engine.bench "$@" --json "$OUT/nsys_bench.json"
nsys stats --force-export true --report cuda_gpu_kern_sum,nvtx_sum --format csv \
  --output "$OUT/nsys_stats" "$OUT/nsys_profile.nsys-rep" > "$OUT/nsys_stats.log" 2>&1 || true
echo "timeline: $OUT/nsys_profile.nsys-rep; summaries: $OUT/nsys_stats_*.csv"
