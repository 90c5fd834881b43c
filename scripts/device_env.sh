# Sourced by the scripts that run on the lent GPU machine: the carried Python 3.12 wheels (.whl/,
# from scripts/prepare_device.sh) installed without their dependencies into /tmp/site, the
# repository and them on PYTHONPATH, unbuffered Python output, and where tables go as they are
# written: $base-<what>.txt (date and device in the name) in $OUT where the device tool sets it, else
# in docs/measured/.

# the call's end, as an epoch second that scripts started from here share (CALL_SECONDS from the
# first one that sources this); `left N`: seconds a step may take, at most N, 10 kept for copying
export DEADLINE=${DEADLINE:-$(($(date +%s) + ${CALL_SECONDS:-600}))}
left() {
    local s=$((DEADLINE - $(date +%s) - 10))
    echo $((s < $1 ? (s > 1 ? s : 1) : $1))
}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.installed ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && touch /tmp/site/.installed
fi
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
stamp="$(date -u +%Y-%m-%d)"
device="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-')"
dest=${OUT:-docs/measured}
mkdir -p "$dest"
base="$dest/$stamp-${device:-gpu}"
