#!/usr/bin/env bash
# Build llama.cpp's `llama-server` for `bench serve --baseline llama-server`, from the llama.cpp
# that the llama-cpp-python source distribution vendors (the same llama.cpp as the latency
# baseline's), with the machine's compiler and its native instructions. About seven minutes on
# two cores. Prints each binary's path, llama-server's last; pass it as --llama-server or
# $LLAMA_SERVER. More targets of the same build (llama-quantize, llama-bench, llama-cli) may follow
# the build directory; they share the one configure and the one libllama.
#
#   perf/build_llama_server.sh [BUILD_DIR [TARGET...]]   (default: ~/.cache/compiled_engine/llama-server)
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
BUILD_DIR="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/compiled_engine/llama-server}"
shift || true
TARGETS=()
for target in "$@"; do
    [ "$target" = llama-server ] || TARGETS+=("$target")
done
TARGETS+=(llama-server)
PYTHON="${PYTHON:-python3}"
command -v cmake >/dev/null || { echo "build_llama_server.sh: cmake is needed (apt-get install -y cmake)" >&2; exit 1; }
mkdir -p "$BUILD_DIR"
SOURCE="$BUILD_DIR/llama_cpp_python-$VERSION"
if [ ! -d "$SOURCE/vendor/llama.cpp" ]; then
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$BUILD_DIR"
    tar -xzf "$BUILD_DIR/llama_cpp_python-$VERSION.tar.gz" -C "$BUILD_DIR"
fi
cmake -S "$SOURCE/vendor/llama.cpp" -B "$BUILD_DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build "$BUILD_DIR/build" --target "${TARGETS[@]}" -j "$(nproc)"
for target in "${TARGETS[@]}"; do
    echo "$BUILD_DIR/build/bin/$target"
done
