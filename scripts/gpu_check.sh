#!/usr/bin/env bash
# The standing GPU check (CONTRACTS.md): the `gpu` tests and both kernel benchmarks, in under 8
# minutes, tables written to docs/measured/ (and to $OUT when the device tool provides it).
#
# On the lent GPU machine, from the repository root (its python3 has numba-cuda, cuda-bindings
# and CuPy, but no gguf or ortools: carry Python 3.12 wheels of gguf, ortools, protobuf and
# immutabledict in the ignored .whl/, fetched as the device README says, and name .whl in carry):
#     bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then  # without their dependencies: one version of each
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
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
