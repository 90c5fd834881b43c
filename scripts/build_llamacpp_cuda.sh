#!/usr/bin/env bash
# llama.cpp with CUDA for sm_90 (H100/H200), built HERE, on any x86-64 machine with CUDA 13.0's nvcc
# and no GPU, so that a lent GPU's 15 minutes are not spent compiling it (~5,000 CPU-seconds: about
# 45 minutes on two cores). From the stripped source scripts/prepare_device.sh put in .gpu-src/; writes
# llama-bench, llama-completion, llama-batched-bench and their shared libraries into
# $LLAMA_CUDA/bin (default ~/.cache/refengine/llama-cuda/bin), then packs them into
# .gpu/llama-cuda-sm90.tar.xz, which the device call carries and unpacks (scripts/device_session.sh).
#     bash scripts/build_llamacpp_cuda.sh        (prepare_device.sh runs it)
# Built to run on a CPU we have not seen: no -march=native (a native build on this AVX2-only host
# would fault there, or slow llama.cpp's CPU half and flatter us in the low-budget rows); instead
# every CPU variant as a backend loaded at run time, which picks the device CPU's best.
# cuBLAS: the toolkit's headers, else the nvidia-cublas wheel's (this machine's toolkit has none);
# at run time the device's own libcublas.so.13 (its nvidia-cublas wheel, device_session.sh finds it).
# The driver library ggml's VMM pool links: the toolkit's stub, else one made here from the names
# ggml-cuda calls (what NVIDIA's stub is: the symbols, no code; the device's libcuda.so.1 serves them).
# Never carry PTX newer than the device's driver reads: driver 580 is CUDA 13.0, as nvcc here.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
root=${LLAMA_CUDA:-${REFENGINE_CACHE:-$HOME/.cache/refengine}/llama-cuda}
version=$(cat .gpu/llama.cpp-version)
pack=$repo/.gpu/llama-cuda-sm90.tar.xz
nvcc_version=$(nvcc --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
[ "$nvcc_version" = 13.0 ] || { echo "nvcc $nvcc_version: the device's driver 580 reads CUDA 13.0 PTX at most; use nvcc 13.0"; exit 1; }
mkdir -p "$root"
echo "building into $root (log: $root/build.log)"
exec >"$root/build.log" 2>&1
date -u +"start %FT%TZ"
# the build folder stays: a second run compiles only what changed (tar keeps the sources' times)
rm -rf "$root/llama.cpp" "$root/bin" "$root/stub" "$root/cublas"
tar -xzf ".gpu-src/llama.cpp-$version-src.tar.gz" -C "$root"
find_wheel_cublas='
import glob, site, sysconfig
roots = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
found = [h for r in roots for h in glob.glob(f"{r}/nvidia/*/include/cublas_v2.h")]
print(found[0].rsplit("/include/", 1)[0] if found else "")'
extra=()
toolkit=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
if [ ! -f "$toolkit/include/cublas_v2.h" ] && [ ! -f /usr/local/cuda/include/cublas_v2.h ]; then
    wheel=${CUBLAS_ROOT:-$(${PYTHON:-python3} -c "$find_wheel_cublas")}
    [ -n "$wheel" ] || { echo "no cuBLAS headers in the toolkit or a wheel: set CUBLAS_ROOT"; exit 1; }
    echo "cuBLAS from $wheel"
    # its headers alone: the wheels' shared include folder also holds a newer CUDA runtime's
    # headers (crt/host_runtime.h), which break nvcc 13.0's own stubs
    mkdir -p "$root/cublas/include"
    cp "$wheel"/include/cublas*.h "$root/cublas/include/"
    extra=(-DCUDA_cublas_LIBRARY="$(ls "$wheel"/lib/libcublas.so.* | head -1)"
           -DCUDA_cublasLt_LIBRARY="$(ls "$wheel"/lib/libcublasLt.so.* | head -1)"
           -DCMAKE_CXX_FLAGS="-I$root/cublas/include" -DCMAKE_CUDA_FLAGS="-I$root/cublas/include")
fi
driver=$(ls "$toolkit"/lib64/stubs/libcuda.so /usr/local/cuda/lib64/stubs/libcuda.so 2>/dev/null |
         head -1 || true)
if [ -z "$driver" ]; then
    mkdir -p "$root/stub"
    # every driver-API name ggml-cuda's sources name, with the _v2/_v3 that cuda.h maps some to
    grep -rhoE '\bcu[A-Z][A-Za-z0-9]+\b' "$root/llama.cpp/ggml/src/ggml-cuda" | sort -u |
        awk '{print "void " $1 "(void) {}"; print "void " $1 "_v2(void) {}"; print "void " $1 "_v3(void) {}"}' \
        >"$root/stub/cuda_stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/stub/libcuda.so" "$root/stub/cuda_stub.c"
    driver=$root/stub/libcuda.so
    echo "libcuda: a stub of $(grep -c . "$root/stub/cuda_stub.c") symbols"
fi
extra+=(-DCUDA_cuda_driver_LIBRARY="$driver")
cmake -S "$root/llama.cpp" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON \
    -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF "${extra[@]}"
# the CPU variants and the CUDA backend are loaded at run time: built as targets of their own
backends=$(ninja -C "$root/build" -t targets all | sed -n 's/^\(ggml-cpu-[a-z0-9_]*\|ggml-cuda\): .*/\1/p' | sort -u)
# shellcheck disable=SC2086
cmake --build "$root/build" -j"$(nproc)" --target llama-bench llama-completion llama-batched-bench $backends
mkdir -p "$root/bin"
cp "$root/build/bin/llama-bench" "$root/build/bin/llama-completion" "$root/build/bin/llama-batched-bench" \
    "$root/bin/"
cp -a "$root"/build/bin/lib*.so* "$root/bin/"
find "$root/bin" -type f -exec strip --strip-unneeded {} +
tar -cJf "$pack" -C "$root" bin
date -u +"done %FT%TZ"
ls -l "$root/bin" "$pack"
