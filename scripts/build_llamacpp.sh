#!/usr/bin/env bash
# Build llama.cpp (CPU + RPC) from the llama-cpp-python sdist on PyPI, once, into the cache:
# ~/.cache/refengine/llama.cpp/<version>/bin (or $REFENGINE_CACHE/llama.cpp/<version>/bin).
# Prints that bin folder. About 12 minutes on two cores the first time; nothing after.
# Keeps ggml's headers and CUDA sources beside it (<version>/ggml, 3 MB): `python -m
# cudarun.sass_check` compiles llama.cpp's decode kernels from them to read their SASS.
set -euo pipefail
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
cache=${REFENGINE_CACHE:-$HOME/.cache/refengine}/llama.cpp/$version
bin=$cache/bin
ggml=$cache/ggml
targets="llama-completion llama-bench ggml-rpc-server llama-batched-bench llama-fit-params llama-quantize"
# The CPU backend without AMX: on an x86 host whose CPU reports AMX (an Intel Xeon among this
# project's CI machines), llama.cpp 0.3.36's AMX matmul faults at its first `ldtilecfg` (a general
# protection fault, every prompt: llama-bench and llama-completion exit 139). -mno-amx-* keeps
# -march=native's other extensions (AVX-512, VNNI) and leaves ggml's AMX code out. The flags
# stamp the build: a build made with other flags is made again.
cflags=""
if [ "$(uname -m)" = x86_64 ] && echo 'int x;' | ${CC:-cc} -mno-amx-tile -x c -c - -o /dev/null 2>/dev/null; then
    cflags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
stamp="flags: $cflags"
done_already() { [ "$(cat "$bin/.complete" 2>/dev/null)" = "$stamp" ] && [ -f "$ggml/.complete" ]; }
if done_already; then echo "$bin"; exit 0; fi
mkdir -p "$cache"
# one build at a time (parallel test workers): a second waits, then finds the first one's
exec 9>"$cache/.build.lock"
flock 9
if done_already; then echo "$bin"; exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
py=${PYTHON:-python3}
"$py" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    -d "$work" "llama-cpp-python==$version" >&2
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -f "$ggml/.complete" ]; then
    rm -rf "$ggml" && mkdir -p "$ggml/src"
    cp -r "$src/ggml/include" "$ggml/" && cp "$src"/ggml/src/*.h "$ggml/src/"
    cp -r "$src/ggml/src/ggml-cuda" "$ggml/src/"
    touch "$ggml/.complete"
fi
if [ "$(cat "$bin/.complete" 2>/dev/null)" = "$stamp" ]; then echo "$bin"; exit 0; fi
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$src" -B "$work/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$cflags" -DCMAKE_CXX_FLAGS="$cflags" >&2
# shellcheck disable=SC2086
cmake --build "$work/build" -j"$(nproc)" --target $targets >&2
rm -rf "$bin" && mkdir -p "$bin"
for t in $targets; do cp "$work/build/bin/$t" "$bin/"; done
echo "$stamp" > "$bin/.complete"
echo "$bin"
