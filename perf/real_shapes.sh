#!/usr/bin/env bash
# The 1B-4B benchmark files, all under OUT_DIR, each step skipped when its output exists:
#   OUT_DIR/<shape>/                     random bf16 weights in the real shapes (perf/real_shapes.py)
#   OUT_DIR/llama.cpp/build/bin/         llama-server, llama-quantize, llama-bench, llama-cli
#                                        (one build, perf/build_llama_server.sh)
#   OUT_DIR/gguf/<shape>-{BF16,Q8_0,Q4_K_M}.gguf   llama.cpp's converter, then its quantizer
# Shapes: llama-3.2-1b, qwen3-1.7b, qwen3-4b (or those in $SHAPES). About 10 minutes for the build
# and a few per shape on two cores; 40 GB of disk for everything.
#
#   PYTHON=.venv/bin/python perf/real_shapes.sh OUT_DIR
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: perf/real_shapes.sh OUT_DIR" >&2; exit 2; }
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
SHAPES="${SHAPES:-llama-3.2-1b qwen3-1.7b qwen3-4b}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

# shellcheck disable=SC2086  # SHAPES is a list of words
PYTHONPATH="$REPO" "$PYTHON" "$REPO/perf/real_shapes.py" "$OUT" --only $SHAPES

LLAMA_DIR="$OUT/llama.cpp"
BIN="$LLAMA_DIR/build/bin"
if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-quantize" ] && [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-cli" ]; then
    echo "llama.cpp tools: already built in $BIN"
else
    PYTHON="$PYTHON" LLAMA_CPP_PYTHON_VERSION="$VERSION" \
        "$REPO/perf/build_llama_server.sh" "$LLAMA_DIR" llama-quantize llama-bench llama-cli llama-server
fi

SOURCE="$LLAMA_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
# The converter imports sentencepiece before it looks for tokenizer.model (and then falls back on
# tokenizer.json): a private copy beside the build, on the converter's path only.
CONVERTER_DEPS="$LLAMA_DIR/converter-deps"
if [ ! -d "$CONVERTER_DEPS/sentencepiece" ]; then
    "$PYTHON" -m pip install --quiet --target "$CONVERTER_DEPS" "sentencepiece>=0.1.98,<0.3.0"
fi
mkdir -p "$OUT/gguf"
for shape in $SHAPES; do
    full="$OUT/gguf/$shape-BF16.gguf"
    if [ ! -f "$full" ]; then
        # The converter's own gguf package, not an installed one: it must know this llama.cpp's keys.
        PYTHONPATH="$SOURCE/gguf-py:$CONVERTER_DEPS" "$PYTHON" "$SOURCE/convert_hf_to_gguf.py" "$OUT/$shape" \
            --outtype bf16 --outfile "$full.partial" 2>&1 | tee "$OUT/gguf/$shape-BF16.log"
        mv "$full.partial" "$full"
    fi
    for type in Q8_0 Q4_K_M; do
        quantized="$OUT/gguf/$shape-$type.gguf"
        [ -f "$quantized" ] && continue
        "$BIN/llama-quantize" "$full" "$quantized.partial" "$type" "$(nproc)" 2>&1 | tee "$OUT/gguf/$shape-$type.log"
        mv "$quantized.partial" "$quantized"
    done
done
ls -l "$OUT/gguf"/*.gguf
echo "llama-server: $BIN/llama-server"
echo "llama-bench: $BIN/llama-bench"
echo "llama-quantize: $BIN/llama-quantize"
echo "llama-cli: $BIN/llama-cli"
