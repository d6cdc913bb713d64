#!/usr/bin/env bash
# The one prepared device command: every GPU check in one call, results under $OUT.
# Run from the repository root on the accelerator machine (torch with CUDA already installed):
#   OUT=/some/dir perf/gpu_check.sh
# Carried wheels in .whl/ (see the device notes in docs/contributing.md) are installed first.
set -uo pipefail
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export COMPILED_ENGINE_CACHE=${COMPILED_ENGINE_CACHE:-$PWD/.cache}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
fi
export PYTHONPATH=$PWD/.site:$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} > "$OUT/environment.txt" 2>&1
status=0
# The accelerator machine has no network and the default model is larger than what can be
# carried, so the checks there use tiny random-weight models unless the model is prepared.
python3 -m pytest -m gpu -q -rs tests > "$OUT/pytest_gpu.log" 2>&1 || status=1
if python3 -c 'from compiled_engine.model.default_model import load_default_model_dir as f; f()' 2>/dev/null; then
  python3 -m compiled_engine generate --device cuda --chat --prompt "What is the capital of France?" \
    --max-tokens 64 > "$OUT/generate.log" 2>&1 || status=1
fi
tail -n 5 "$OUT"/*.log
exit $status
