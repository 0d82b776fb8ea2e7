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
# shellcheck source=scripts/gpu_model_env.sh
source scripts/gpu_model_env.sh  # PYTHONPATH, and the model joined into $M
# shellcheck disable=SC2086
timeout "${EVAL_TIMEOUT:-300}" "$PY" -m lserve eval --model "$M" --device cuda --dtype float32 \
    ${EVAL_ARGS:?set EVAL_ARGS} --out "$OUT/${EVAL_NAME:-accuracy}" 2>&1 | tail -n 40
echo "== eval rc=${PIPESTATUS[0]}"
