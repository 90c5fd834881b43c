#!/usr/bin/env bash
# Issue 17 on a lent GPU in two calls that fit a session's 15 minutes of device time, the machine's
# start included. First, here: bash scripts/prepare_device.sh. Then, through the device tool, each
# call with carry [".whl", ".gpu"], the second at once after the first's reply (the machine stays
# warm 30 s; a fresh one starts everything again):
#   1. CALL_SECONDS=330 bash scripts/device_session.sh 1   (timeout_s 360) llama.cpp's CUDA build and
#      the 8B-shaped Q4_K_M model start in the background (setsid: they outlive the call); the
#      standing check (gpu_check.sh); the runtime against the NumPy engine on synthetic SmolLM2-135M-
#      and Gemma-3-270M-shaped models, three plans each.
#   2. CALL_SECONDS=<budget_left_s - 60> bash scripts/device_session.sh 2   (timeout_s that + 20)
#      the 8B-shaped model at 100%, 50% and 25% of its weights: refengine beside llama.cpp's --fit
#      and beside llama.cpp with our flags.
# Each step's time limit is what is left of CALL_SECONDS; everything is written to $OUT as it is
# measured (copy it under docs/measured/ here).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
export OUT=${OUT:-/tmp/out} REFENGINE_MODELS=/tmp/models LLAMA_CUDA=/tmp/llama-cuda
mkdir -p "$OUT" "$REFENGINE_MODELS" "$LLAMA_CUDA"
model="$REFENGINE_MODELS/llama3-8b-q4km.gguf"
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
start_background() {  # once per machine: pid files say what runs, .complete and $model what is done
    if [ ! -f "$LLAMA_CUDA/bin/.complete" ] && ! alive "$LLAMA_CUDA/build.pid"; then
        setsid sh -c "echo \$\$ >$LLAMA_CUDA/build.pid; exec nice -n 19 bash scripts/build_llamacpp_cuda.sh" \
            </dev/null >/dev/null 2>&1 &
    fi
    if [ ! -f "$model" ] && ! alive "$model.pid"; then
        setsid sh -c "echo \$\$ >$model.pid; exec nice -n 19 sh -c '$PY -m refengine synth \
            --preset llama3-8b --qtype Q4_K_M $model.part && mv $model.part $model'" \
            </dev/null >"$REFENGINE_MODELS/synth.log" 2>&1 &
    fi
}
case "${1:-}" in
1)
    nvidia-smi -L | tee "$OUT/$stamp-${device:-gpu}-smi.txt"
    start_background
    # the carried wheels in use (a regular `google` package of the image would hide protobuf 6)
    $PY -c 'import google.protobuf as p, ortools, gguf; print("protobuf", p.__version__, "ortools", ortools.__version__)'
    GPU_TESTS_SECONDS=120 KERNELS_SECONDS=200 bash scripts/gpu_check.sh
    timeout "$(left 110)" $PY scripts/runtime_gpu_check.py --stage agreement --profile h100
    echo "== llama.cpp CUDA build: $(tail -1 "$LLAMA_CUDA/build.log" 2>/dev/null)"
    ;;
2)
    start_background  # a fresh machine: everything again
    while [ "$(left 1000)" -gt 200 ]; do  # then the table anyway: refengine's columns need no build
        [ -f "$LLAMA_CUDA/bin/.complete" ] && [ -f "$model" ] && break
        if { [ ! -f "$LLAMA_CUDA/bin/.complete" ] && ! alive "$LLAMA_CUDA/build.pid"; } ||
           { [ ! -f "$model" ] && ! alive "$model.pid"; }; then
            echo "the llama.cpp build or the model writer stopped unfinished"
            break
        fi
        sleep 3
    done
    cp "$LLAMA_CUDA/build.log" "$OUT/$stamp-${device:-gpu}-llama-build.txt" 2>/dev/null
    tail -n 3 "$LLAMA_CUDA/build.log" "$REFENGINE_MODELS/synth.log"
    [ -f "$LLAMA_CUDA/env.sh" ] && source "$LLAMA_CUDA/env.sh"  # cuBLAS from a wheel
    ldd "$LLAMA_CUDA/bin/llama-bench" | grep "not found"
    table="$OUT/$stamp-${device:-gpu}-vs-llamacpp.txt"
    nvidia-smi -L >"$table"
    timeout "$(left 1000)" $PY scripts/gpu_vs_llamacpp.py "$model" \
        --llama-bin "$LLAMA_CUDA/bin" -r "${REPS:-1}" --out "$table"
    ;;
*)
    echo "usage: bash scripts/device_session.sh 1|2" >&2
    exit 2
    ;;
esac
