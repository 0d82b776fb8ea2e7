#!/usr/bin/env bash
# On a CUDA machine: `lserve eval` of the default model (torch backend, fp32: minutes instead of
# hours on the CPU), e.g. the adaptive-budget accuracy suite at n >= 20 per cell.
#   OUT=/some/dir EVAL_ARGS="--tasks passkey --contexts 2048 ..." bash scripts/gpu_eval.sh
# The model travels as in scripts/gpu_gates.sh: a first call carries .m1 (stashed in /tmp/model:
# `mkdir -p /tmp/model && cp .m1/* /tmp/model/`), the next (while the machine is warm) carries .m2
# and .whl (the gguf wheel) and runs this. EVAL_TIMEOUT (s, default 300) bounds the eval; the
# per-case JSONL it writes as it goes comes back even when the time runs out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/eval_out}"
mkdir -p "$OUT"
PY="${PY:-python3}"
export PYTHONUNBUFFERED=1
if ! "$PY" -c "import gguf" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
if ! "$PY" -c "import lserve.kernels.loader" 2>/dev/null; then
    ln -sfn ../kernels lserve/kernels
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
M=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf
parts=()
for p in gg.aa gg.ab; do
    for d in .m1 .m2 /tmp/model; do [ -f "$d/$p" ] && { parts+=("$d/$p"); break; }; done
done
[ "${#parts[@]}" -eq 2 ] || { echo "model parts missing: ${parts[*]}"; exit 1; }
mkdir -p /tmp/model && cat "${parts[@]}" > "$M" || exit 1
# shellcheck disable=SC2086
timeout "${EVAL_TIMEOUT:-300}" "$PY" -m lserve eval --model "$M" --device cuda --dtype float32 \
    ${EVAL_ARGS:?set EVAL_ARGS} --out "$OUT/${EVAL_NAME:-accuracy}" 2>&1 | tail -n 40
echo "== eval rc=${PIPESTATUS[0]}"
