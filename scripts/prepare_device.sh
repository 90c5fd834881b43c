#!/usr/bin/env bash
# Run here, before a session's first call to the lent GPU machine (which reaches no network):
# fills the ignored folders that the calls carry (scripts/device_session.sh says how to call).
#   .whl/  Python 3.12 wheels the GPU image lacks (gguf, ortools, protobuf, immutabledict),
#          fetched as the device README says; scripts/device_env.sh installs them there.
#   .gpu/  llama.cpp's CUDA build for sm_90 (llama-bench, llama-completion, llama-batched-bench and
#          their libraries, xz-compressed), built here by scripts/build_llamacpp_cuda.sh from the
#          llama-cpp-python sdist our CPU build uses, stripped to what that build reads (the CPU and
#          CUDA backends of ggml, src, include, common, the tools, cmake, vendor; in .gpu-src/).
# The build takes about 45 minutes on two cores, once: an existing .gpu/ pack is kept (REBUILD=1
# builds it again). Prints what the call carries, which must stay under 64 MiB with the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
py=${PYTHON:-.venv/bin/python}
download() {  # the device README's recipe: one version of each, no dependencies
    "$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$@"
}
rm -rf .whl
mkdir -p .whl .gpu .gpu-src
# the versions this checkout is tested with, so the device runs what CI runs
pins=$("$py" - <<'EOF'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("gguf", "ortools", "protobuf", "immutabledict")))
EOF
)
# shellcheck disable=SC2086
download $pins

if [ -f ".gpu-src/llama.cpp-$version-src.tar.gz" ]; then
    echo "$version" >.gpu/llama.cpp-version
else
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$py" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        -d "$work" "llama-cpp-python==$version"
    tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
    src="$work/llama_cpp_python-$version/vendor/llama.cpp"
    keep=(CMakeLists.txt LICENSE app cmake common include src vendor tools ggml/CMakeLists.txt ggml/cmake
          ggml/include)
    (cd "$src" && for f in ggml/src/*; do  # ggml's own sources, and of its backends the CPU's and CUDA's
        if [ -d "$f" ] && [ "$f" != ggml/src/ggml-cpu ] && [ "$f" != ggml/src/ggml-cuda ]; then
            continue
        fi
        echo "$f"
    done) >"$work/ggml-src.txt"
    mapfile -t ggml_src <"$work/ggml-src.txt"
    # the web UI, the server and the tools' test data are for llama-server, which is not built
    tar -czf ".gpu-src/llama.cpp-$version-src.tar.gz" -C "$src" --exclude=tools/ui --exclude=tools/server \
        --transform "s,^,llama.cpp/," "${keep[@]}" "${ggml_src[@]}"
    echo "$version" >.gpu/llama.cpp-version
fi
if [ ! -f .gpu/llama-cuda-sm90.tar.xz ] || [ -n "${REBUILD:-}" ]; then
    "$py" -m pip install --quiet --disable-pip-version-check 'nvidia-cublas>=13'  # its headers (pyproject's gpu extra)
    PYTHON=$py bash scripts/build_llamacpp_cuda.sh
fi
du -sh .whl .gpu
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
for carried in .gpu .whl; do  # one call each (device_session.sh): each under 64 MiB with the tree
    echo "the call carrying $carried: $(( ($(du -sb $carried | cut -f1) + tree) >> 20 )) MiB of 64"
done
