#!/usr/bin/env bash
# On the lent GPU machine: llama.cpp with CUDA for sm_90 (H100/H200) only, from the stripped source
# scripts/prepare_device.sh put in .gpu/ (carried). Builds llama-bench, llama-completion and
# llama-batched-bench into $LLAMA_CUDA/bin (default /tmp/llama-cuda/bin), writes $LLAMA_CUDA/build.log
# and touches bin/.complete when done; where cuBLAS came from a wheel, $LLAMA_CUDA/env.sh sets the
# library path the binaries need (source it before running them). About 5-7 minutes on 16 cores:
# start it in the background in a new process session, which outlives the call, and go on:
#     setsid bash scripts/build_llamacpp_cuda.sh </dev/null >/dev/null 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
root=${LLAMA_CUDA:-/tmp/llama-cuda}
version=$(cat .gpu/llama.cpp-version)
mkdir -p "$root"
exec >"$root/build.log" 2>&1
[ -f "$root/bin/.complete" ] && { echo "built already"; exit 0; }
date -u +"start %FT%TZ"
rm -rf "$root/llama.cpp" "$root/build" "$root/env.sh"
tar -xzf ".gpu/llama.cpp-$version-src.tar.gz" -C "$root"
# cuBLAS: the toolkit's, or else the nvidia-cublas wheel's (cu13 wheels keep lib/ and include/ in
# nvidia/cu13/), which CMake's FindCUDAToolkit does not search: named to it and to the compilers
find_wheel_cublas='
import glob, site, sysconfig
roots = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
found = [h for r in roots for h in glob.glob(f"{r}/nvidia/*/include/cublas_v2.h")]
print(found[0].rsplit("/include/", 1)[0] if found else "")'
cublas=()
toolkit=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
if [ ! -f "$toolkit/include/cublas_v2.h" ] && [ ! -f /usr/local/cuda/include/cublas_v2.h ]; then
    wheel=${CUBLAS_ROOT:-$(${PYTHON:-python3} -c "$find_wheel_cublas")}
    [ -n "$wheel" ] || { echo "no cuBLAS headers in the CUDA toolkit or a wheel"; exit 1; }
    echo "cuBLAS from $wheel"
    cublas=(-DCUDA_cublas_LIBRARY="$(ls "$wheel"/lib/libcublas.so.* | head -1)"
            -DCUDA_cublasLt_LIBRARY="$(ls "$wheel"/lib/libcublasLt.so.* | head -1)"
            -DCMAKE_CXX_FLAGS="-I$wheel/include" -DCMAKE_CUDA_FLAGS="-I$wheel/include")
    echo "export LD_LIBRARY_PATH=$wheel/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" >"$root/env.sh"
fi
# the driver library ggml's VMM pool links: the toolkit's stub, or the driver's own (a GPU machine
# may have only libcuda.so.1, which find_library does not take); else no VMM pool
driver=$(ls "$toolkit"/lib64/stubs/libcuda.so /usr/local/cuda/lib64/stubs/libcuda.so 2>/dev/null |
         head -1 || true)
[ -n "$driver" ] || driver=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so/ && !f {print $NF; f=1}')
[ -n "$driver" ] || driver=$(ls /usr/local/nvidia/lib64/libcuda.so* 2>/dev/null | head -1 || true)
if [ -n "$driver" ]; then
    cublas+=(-DCUDA_cuda_driver_LIBRARY="$driver")
else
    echo "no libcuda: building without the VMM pool"
    cublas+=(-DGGML_CUDA_NO_VMM=ON)
fi
cmake -S "$root/llama.cpp" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF "${cublas[@]}"
cmake --build "$root/build" -j"$(nproc)" --target llama-bench llama-completion llama-batched-bench
mkdir -p "$root/bin"
cp "$root/build/bin/llama-bench" "$root/build/bin/llama-completion" \
    "$root/build/bin/llama-batched-bench" "$root/bin/"
touch "$root/bin/.complete"
date -u +"done %FT%TZ"
