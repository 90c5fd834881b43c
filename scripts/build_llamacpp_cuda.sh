#!/usr/bin/env bash
# On the lent GPU machine: llama.cpp with CUDA for sm_90 (H100/H200) only, from the stripped source
# scripts/prepare_device.sh put in .gpu/ (carried). Builds llama-bench, llama-completion and
# llama-batched-bench into $LLAMA_CUDA/bin (default /tmp/llama-cuda/bin), writes $LLAMA_CUDA/build.log
# and touches bin/.complete when done. About 5-7 minutes on 16 cores: start it in the background in
# a new process session, which outlives the call, and go on with other checks:
#     setsid bash scripts/build_llamacpp_cuda.sh </dev/null >/dev/null 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
root=${LLAMA_CUDA:-/tmp/llama-cuda}
version=$(cat .gpu/llama.cpp-version)
mkdir -p "$root"
exec >"$root/build.log" 2>&1
[ -f "$root/bin/.complete" ] && { echo "built already"; exit 0; }
date -u +"start %FT%TZ"
rm -rf "$root/llama.cpp" "$root/build"
tar -xzf ".gpu/llama.cpp-$version-src.tar.gz" -C "$root"
cmake -S "$root/llama.cpp" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF
cmake --build "$root/build" -j"$(nproc)" --target llama-bench llama-completion llama-batched-bench
mkdir -p "$root/bin"
cp "$root/build/bin/llama-bench" "$root/build/bin/llama-completion" \
    "$root/build/bin/llama-batched-bench" "$root/bin/"
touch "$root/bin/.complete"
date -u +"done %FT%TZ"
