#!/usr/bin/env bash
# llama.cpp's llama-server, llama-batched-bench and llama-quantize for `attnserve bench compare`
# (bench/peers/llama_cpp.py), and llama-tokenize for the GGUF import's tests (tests/bench/test_gguf_llama_cpp.py),
# built as a user builds them for this CPU: cmake with GGML_NATIVE=ON, from the llama.cpp source that the
# llama-cpp-python sdist vendors (PyPI is the one registry these machines reach).
# No source is patched.
#
#   bench/peers/build-llama-cpp.sh           # prints the folder that holds the programs
#   bench/peers/build-llama-cpp.sh --where   # builds nothing: prints that folder and the llama.cpp source's
#
# The build takes about 10 minutes on 2 cores, so it is cached under ~/.cache/attnserve/peers, in a folder
# named for the version and this CPU's flags: a build for one CPU may not run on another.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PYTHON="${PYTHON:-python3}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/attnserve/peers"
SRC="$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp"
CPU="$(grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-8)"
BUILD="$CACHE/llama.cpp-$VERSION-$CPU"
PROGRAMS=(llama-server llama-batched-bench llama-quantize llama-tokenize)

say() { echo "[build-llama-cpp] $*" >&2; }

if [ "${1:-}" = "--where" ]; then
    printf '%s\n%s\n' "$BUILD/bin" "$SRC"
    exit 0
fi
built=1
for program in "${PROGRAMS[@]}"; do
    [ -x "$BUILD/bin/$program" ] || built=0
done
if [ "$built" = 1 ] && "$BUILD/bin/llama-server" --version >/dev/null 2>&1; then
    echo "$BUILD/bin"
    exit 0
fi
mkdir -p "$CACHE"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    say "fetching the llama-cpp-python $VERSION sdist from PyPI"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
    tar xzf "$CACHE/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
fi
say "building ${PROGRAMS[*]} in $BUILD (about 10 minutes on 2 cores)"
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF >&2  # static: the programs run from anywhere
cmake --build "$BUILD" -j"$(nproc)" --target "${PROGRAMS[@]}" >&2
echo "$BUILD/bin"
