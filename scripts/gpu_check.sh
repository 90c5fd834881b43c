#!/usr/bin/env bash
# The standing GPU check (CONTRACTS.md): the `gpu` tests and both kernel benchmarks, in under 8
# minutes, tables written to docs/measured/ (and to $OUT when the device tool provides it).
#
# On the lent GPU machine, from the repository root (its python3 has numba-cuda, cuda-bindings
# and CuPy; carry a gguf wheel in wheels/, and an ortools wheel set for tests that solve):
#     bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d wheels ]; then
    $PY -m pip install --quiet --no-index --find-links wheels gguf ortools 2>/dev/null \
        || $PY -m pip install --quiet --no-index --find-links wheels gguf
fi
stamp="$(date -u +%Y-%m-%d)"
device="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-')"
dir="docs/measured"
mkdir -p "$dir"
base="$dir/$stamp-${device:-gpu}"
status=0

echo "== gpu tests"
timeout 240 $PY -m pytest -q -m gpu tests/ 2>&1 | tee "$base-gpu-tests.txt" | tail -20
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== kernel benchmarks (GPU, then this host's CPU)"
timeout 300 $PY -m refengine bench-kernels --gpu --cpu --tokens 1 -o "$base-kernels.txt" \
    || status=1

if [ -n "${OUT:-}" ]; then
    cp "$base"-*.txt "$OUT"/
fi
exit $status
