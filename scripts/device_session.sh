#!/usr/bin/env bash
# Issue 17 on a lent GPU in two calls that fit a session's 15 minutes of device time. First, here:
# bash scripts/prepare_device.sh. Then, through the device tool, each call with carry
# [".whl", ".gpu"], the second at once after the first (the machine stays warm only 30 s):
#   1. bash scripts/device_session.sh 1   (timeout_s 420) llama.cpp's CUDA build and the 8B-shaped
#      model start in the background (setsid: they outlive the call); the standing check
#      (gpu_check.sh); the runtime against the NumPy engine on synthetic SmolLM2-135M- and
#      Gemma-3-270M-shaped models, three plans each.
#   2. bash scripts/device_session.sh 2   (timeout_s 420) the 8B-shaped Q4_K_M model at 100%, 50%
#      and 25% of its weights: refengine beside llama.cpp's --fit and llama.cpp with our flags.
# Everything is written to $OUT as it is measured; copy it under docs/measured/ here.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
export OUT=${OUT:-/tmp/out} REFENGINE_MODELS=/tmp/models LLAMA_CUDA=/tmp/llama-cuda
mkdir -p "$OUT" "$REFENGINE_MODELS"
model="$REFENGINE_MODELS/llama3-8b-q4km.gguf"
start_background() {
    if [ ! -f "$LLAMA_CUDA/bin/.complete" ] && ! pgrep -f build_llamacpp_cuda.sh >/dev/null; then
        setsid bash scripts/build_llamacpp_cuda.sh </dev/null >/dev/null 2>&1 &
    fi
    if [ ! -f "$model" ] && ! pgrep -f "synth --preset llama3-8b" >/dev/null; then
        setsid sh -c "$PY -m refengine synth --preset llama3-8b $model.part && mv $model.part $model" \
            </dev/null >"$REFENGINE_MODELS/synth.log" 2>&1 &
    fi
}
case "${1:-}" in
1)
    nvidia-smi -L | tee "$OUT/$stamp-${device:-gpu}-smi.txt"
    start_background
    bash scripts/gpu_check.sh
    timeout "${AGREEMENT_SECONDS:-110}" $PY scripts/runtime_gpu_check.py --stage agreement \
        --profile h100
    echo "== llama.cpp CUDA build: $(tail -1 "$LLAMA_CUDA/build.log" 2>/dev/null)"
    ;;
2)
    start_background  # a fresh machine: everything again
    for _ in $(seq 60); do
        [ -f "$LLAMA_CUDA/bin/.complete" ] && [ -f "$model" ] && break
        sleep 5
    done
    tail -3 "$LLAMA_CUDA/build.log"
    table="$OUT/$stamp-${device:-gpu}-vs-llamacpp.txt"
    nvidia-smi -L >"$table"
    timeout "${VS_SECONDS:-330}" $PY scripts/gpu_vs_llamacpp.py "$model" \
        --llama-bin "$LLAMA_CUDA/bin" -r "${REPS:-1}" --out "$table"
    ;;
*)
    echo "usage: bash scripts/device_session.sh 1|2" >&2
    exit 2
    ;;
esac
