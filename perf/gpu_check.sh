#!/usr/bin/env bash
# The one prepared device command: every GPU check and the GPU bench in one call, results under
# $OUT. Run from the repository root on the accelerator machine (torch with CUDA installed):
#   OUT=/some/dir perf/gpu_check.sh            # QUICK=1 skips the Llama-3-8B-shaped model
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
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, remember a failure
  local name=$1; shift
  local started=$SECONDS
  if "$@" > "$OUT/$name.log" 2>&1; then echo "ok    $name ($((SECONDS - started)) s)"; else echo "FAIL  $name ($((SECONDS - started)) s)"; status=1; fi
}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' || echo "flashinfer not installed"
  python3 -c 'import transformers; print("transformers", transformers.__version__)'
} > "$OUT/environment.txt" 2>&1

step pytest_gpu python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests

# No network and no room to carry real weights: random-weight models with real shapes.
for shape in smollm2-135m qwen3-0.6b; do
  [ -d "$MODELS/$shape" ] || step "make_$shape" python3 perf/random_model.py "$shape" "$MODELS/$shape" --device cuda
done
BENCH="python3 -m compiled_engine.bench"
step bench_latency_smollm2 $BENCH latency --model "$MODELS/smollm2-135m" --device cuda --prompt-len 512 --output-len 128 --baseline hf --json "$OUT/latency_smollm2.json"
step bench_latency_smollm2_eager $BENCH latency --model "$MODELS/smollm2-135m" --device cuda --prompt-len 512 --output-len 128 --enforce-eager --json "$OUT/latency_smollm2_eager.json"
step bench_offline_qwen3 $BENCH offline --model "$MODELS/qwen3-0.6b" --device cuda --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --baseline hf --hf-batch-size 64 --json "$OUT/offline_qwen3.json"
if [ "${QUICK:-0}" != 1 ]; then
  [ -d "$MODELS/llama3-8b" ] || step make_llama3-8b python3 perf/random_model.py llama3-8b "$MODELS/llama3-8b" --device cuda
  step bench_latency_llama3_8b $BENCH latency --model "$MODELS/llama3-8b" --device cuda --prompt-len 512 --output-len 128 --json "$OUT/latency_llama3_8b.json"
fi
tail -n 3 "$OUT"/*.log > "$OUT/summary.txt" 2>&1
exit $status
