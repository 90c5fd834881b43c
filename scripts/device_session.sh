#!/usr/bin/env bash
# A lent GPU's work (the GPU issue) in one call that fits a session's 15 minutes of device time
# with the machine's start: scripts/device_call.py's stages (agreement, kernel table, refengine
# beside llama.cpp, the gpu tests), each written to $OUT as it is measured.
# First, here (no GPU needed): bash scripts/prepare_device.sh  (the wheels; llama.cpp's CUDA build,
# ~45 minutes on two cores, once). llama.cpp's build (42 MiB packed) and the wheels (29 MiB, most
# of it ortools) do not travel together under the 64 MiB a call carries, so llama.cpp goes first,
# in a call of seconds, and the work follows AT ONCE (the machine stays warm 30 s; the ignored
# .gpu/ and what the first call unpacked stay there):
#     1. bash scripts/device_session.sh unpack            carry [".gpu"], timeout_s 120
#     2. CALL_SECONDS=560 bash scripts/device_session.sh    carry [".whl"], timeout_s 590
# Should call 2 land on a fresh machine, everything but llama.cpp's columns still runs.
# A third call, if device time is left, only adds rows (the 8B-shaped model stays in /tmp/models
# while the machine is warm; a fresh machine writes it again):
#     CALL_SECONDS=<left - 30> STAGES=agreement-1.5b,eight-b,per-test bash scripts/device_session.sh
#     (carry [".whl"] again: a fresh machine has none of the first calls' files)
# CALL_ARGS go to device_call.py as they are (e.g. "--agreement-models smollm2-135m"); STAGES may
# name agreement-serial, the SmolLM2-shaped cases with a wait after every operation, or where-8b,
# the all-pinned 8B-shaped prompt timed and profiled (a smaller file written in a short call:
# CALL_ARGS="--synth-8b=--preset,llama3-8b,--layers,8,--vocab,32000,--qtype,Q4_K_M
# --model-8b /tmp/models/l8b-8.gguf").
set -uo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
PY=${PYTHON:-python3}
# the device has no package index: pip must never try one
export PIP_NO_INDEX=1 PYTHONUNBUFFERED=1 REFENGINE_MODELS=/tmp/models
# llama.cpp's CUDA build, carried (scripts/build_llamacpp_cuda.sh); cuBLAS is the image's wheel's
llama=/tmp/llama-cuda
if [ ! -x "$llama/bin/llama-bench" ] && [ -f .gpu/llama-cuda-sm90.tar.xz ]; then
    mkdir -p "$llama" && tar -xJf .gpu/llama-cuda-sm90.tar.xz -C "$llama"
fi
if [ "${1:-}" = unpack ]; then
    ls "$llama/bin" | wc -l && nvidia-smi -L
    exit 0
fi
# the carried Python 3.12 wheels (.whl/) the image lacks, without their dependencies
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.installed ]; then
    $PY -m pip install -q --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && touch /tmp/site/.installed
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}:/tmp/site"
# the carried wheels in use (a regular `google` package of the image would hide protobuf 6)
$PY -c 'import google.protobuf as p, ortools, gguf; print("protobuf", p.__version__, "ortools", ortools.__version__)' ||
    { echo "error: ortools or gguf missing: this call must carry .whl (scripts/prepare_device.sh fills it)"; exit 2; }
cublas=$($PY -c 'import glob, site; print(":".join(sorted({p.rsplit("/", 1)[0] for r in site.getsitepackages() for p in glob.glob(f"{r}/nvidia/*/lib/libcublas.so.*")})))')
# libcudart.so.13 and libcublas.so.13: the image's cu13 wheels, else its toolkit
export LD_LIBRARY_PATH="$llama/bin${cublas:+:$cublas}:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -x "$llama/bin/llama-bench" ] && ldd "$llama/bin/libggml-cuda.so" | grep "not found"
echo "setup: $(($(date +%s) - started)) s"
exec $PY scripts/device_call.py --seconds $((${CALL_SECONDS:-560} - $(date +%s) + started)) \
    --llama-bin "$llama/bin" --stages "${STAGES:-agreement,kernels,vs-llamacpp,gpu-tests}" ${CALL_ARGS:-}
