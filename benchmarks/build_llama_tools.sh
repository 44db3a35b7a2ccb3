#!/usr/bin/env bash
# Build llama.cpp's command-line tools `llama-imatrix` and `llama-perplexity` from the source that the benchmark
# venv's llama-cpp-python ships (its PyPI sdist vendors llama.cpp; the pip wheel builds only the shared library).
# bench_accuracy_bpw.py --llama-imatrix runs llama-imatrix from here (the quantizing itself stays in the venv's
# llama_model_quantize, with the imatrix passed in). Only those targets are built; nothing is installed.
#
#   bash benchmarks/build_llama_tools.sh [SDIST.tar.gz] [DEST]    # DEST default: .llama-tools in the repo root
#   JOBS=2 NICE=10 bash benchmarks/build_llama_tools.sh /tmp/lcp/llama_cpp_python-0.3.36.tar.gz /work/data/llama-tools
#
# No SDIST (or "-"): `pip download llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION --no-deps --no-binary :all:`
# (default 0.3.36, the benchmark venv's version). DEST gets bin/llama-imatrix, bin/llama-perplexity (and the
# build tree under DEST/build). Needs cmake and a C++17 compiler; JOBS (default 2) parallel jobs at `nice -n
# $NICE` (default 10). Use the tools with --llama-tools DEST or AFFINEQ_LLAMA_TOOLS=DEST.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SDIST="${1:--}"
DEST="${2:-$ROOT/.llama-tools}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"

mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
if [[ "$SDIST" == "-" ]]; then
  python -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$DEST/sdist"
  SDIST="$(ls "$DEST"/sdist/llama_cpp_python-"$VERSION".tar.gz)"
fi
[[ -f "$SDIST" ]] || { echo "build_llama_tools: no such file: $SDIST" >&2; exit 1; }

SRC="$DEST/src"
rm -rf "$SRC" && mkdir -p "$SRC"
tar xzf "$SDIST" -C "$SRC" --strip-components=1
LLAMA="$SRC/vendor/llama.cpp"
[[ -d "$LLAMA/tools/imatrix" ]] || { echo "build_llama_tools: $SDIST has no vendor/llama.cpp/tools/imatrix" >&2; exit 1; }

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
nice -n "$NICE" cmake -S "$LLAMA" -B "$DEST/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON
nice -n "$NICE" cmake --build "$DEST/build" --config Release -j "$JOBS" --target llama-imatrix llama-perplexity

mkdir -p "$DEST/bin"
for t in llama-imatrix llama-perplexity; do
  cp "$DEST/build/bin/$t" "$DEST/bin/$t"
done
"$DEST/bin/llama-imatrix" --help >/dev/null 2>&1 || true
echo "built: $DEST/bin/llama-imatrix $DEST/bin/llama-perplexity (llama-cpp-python $VERSION's llama.cpp)"
