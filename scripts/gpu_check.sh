#!/usr/bin/env bash
# The standing GPU check (CONTRACTS.md): the `gpu` tests and the GPU kernel table, each under its
# own time limit and written as it goes (to $OUT on the device machine, else docs/measured/). The
# first thing any session with a GPU runs (scripts/device_session.sh 1 runs it). Carry .whl
# (scripts/prepare_device.sh).
#     bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
status=0

echo "== gpu tests"
{ nvidia-smi -L; timeout "$(left "${GPU_TESTS_SECONDS:-150}")" $PY -m pytest -q -n 0 -m gpu -p no:cacheprovider \
    tests/ 2>&1; } | tee "$base-gpu-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== GPU kernel table (rows as they are measured)"
timeout "$(left "${KERNELS_SECONDS:-100}")" $PY -m refengine bench-kernels --gpu --no-cpu \
    --types "${KERNEL_TYPES:-Q4_K,Q6_K,Q8_0}" -o "$base-kernels.txt" || status=1
if [ -f "$base-kernels.txt" ]; then  # the machine's line at the top
    { nvidia-smi -L; cat "$base-kernels.txt"; } >"$base-kernels.tmp" && mv "$base-kernels.tmp" "$base-kernels.txt"
fi
exit $status
