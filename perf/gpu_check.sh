#!/usr/bin/env bash
# The one prepared device command: every GPU check and the GPU bench in one call, results under
# $OUT. Run from the repository root on the accelerator machine (torch with CUDA installed):
#   OUT=/some/dir perf/gpu_check.sh   # everything (longer than one 10-minute call)
#   QUICK=1: the GPU tests and the SmolLM2 latency (about 540 s on a fresh H200, FlashInfer's JIT included)
#   BENCH_ONLY=1: no tests; the SmolLM2 latency and a short Qwen3 offline run
# Carried wheels in .whl/ (see docs/contributing.md) are installed first. Each step logs to its
# own file; the script goes on after a failure and exits non-zero if any step failed.
set -uo pipefail
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export COMPILED_ENGINE_CACHE=${COMPILED_ENGINE_CACHE:-$PWD/.cache}
MODELS=${MODELS:-$PWD/.cache/random_models}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl > "$OUT/pip.log" 2>&1
fi
export PYTHONPATH=$PWD/.site:$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, remember a failure
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then echo "ok    $name ($((SECONDS - started)) s)"; else echo "FAIL  $name ($((SECONDS - started)) s, rc $?)"; status=1; fi
}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' || echo "flashinfer not installed"
  python3 -c 'import transformers; print("transformers", transformers.__version__)'
} > "$OUT/environment.txt" 2>&1

# The GPU test files only: the server tests import packages (openai, schemathesis) that the
# accelerator machine lacks. CUDA graphs and the eager GPU path first; everything FlashInfer
# (attention against torch, graph replay with FlashInfer, its sampling) compiles its kernels on
# first use (about 30 s each), so it gets its own, longer, limit.
GPU_TESTS="tests/test_cuda_graphs.py tests/test_gpu_eager.py tests/test_sampler.py"
if [ "${BENCH_ONLY:-0}" != 1 ]; then
  step pytest_gpu 200 python3 -m pytest -m gpu -k "not flashinfer" -q -rs -p no:cacheprovider $GPU_TESTS
  step pytest_flashinfer 480 python3 -m pytest -m gpu -k flashinfer -q -rs -p no:cacheprovider tests/test_flashinfer.py $GPU_TESTS
fi

# No network and no room to carry real weights: random-weight models with real shapes.
for shape in smollm2-135m qwen3-0.6b; do
  [ -d "$MODELS/$shape" ] || step "make_$shape" 120 python3 perf/random_model.py "$shape" "$MODELS/$shape" --device cuda
done
BENCH="python3 -m compiled_engine.bench"
step bench_latency_smollm2 150 $BENCH latency --model "$MODELS/smollm2-135m" --device cuda --prompt-len 512 --output-len 128 --baseline hf --json "$OUT/latency_smollm2.json"
if [ "${BENCH_ONLY:-0}" = 1 ]; then  # a short offline run (QUICK=1 has no room left for one)
  step bench_offline_qwen3 150 $BENCH offline --model "$MODELS/qwen3-0.6b" --device cuda --num-seqs 64 --input-len 100 512 --output-len 100 256 --baseline hf --hf-batch-size 64 --json "$OUT/offline_qwen3.json"
elif [ "${QUICK:-0}" != 1 ]; then
  step bench_latency_smollm2_eager 120 $BENCH latency --model "$MODELS/smollm2-135m" --device cuda --prompt-len 512 --output-len 128 --enforce-eager --json "$OUT/latency_smollm2_eager.json"
  step bench_offline_qwen3 300 $BENCH offline --model "$MODELS/qwen3-0.6b" --device cuda --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --baseline hf --hf-batch-size 64 --json "$OUT/offline_qwen3.json"
  [ -d "$MODELS/llama3-8b" ] || step make_llama3-8b 300 python3 perf/random_model.py llama3-8b "$MODELS/llama3-8b" --device cuda
  step bench_latency_llama3_8b 300 $BENCH latency --model "$MODELS/llama3-8b" --device cuda --prompt-len 512 --output-len 128 --json "$OUT/latency_llama3_8b.json"
fi
tail -n 3 "$OUT"/*.log > "$OUT/summary.txt" 2>&1
exit $status
