#!/usr/bin/env bash
# On the GPU machine: the host KV tier benchmarks (issue 39), several runs in one device call.
#   OUT=$OUT HT_RUNS=2 HT_ARGS_1="--capacity" HT_ARGS_2="--contexts 131072,524288 ..." bash scripts/gpu_host_tier.sh
# Run i: python -m lserve.bench.host_tier $OUT $HT_ARGS_i, its log as host_tier_$i.log (JSON/PNG named
# by the bench: host_tier_h200.*, host_tier_capacity.json, host_tier_concurrency.json).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
rc=0
for i in $(seq 1 "${HT_RUNS:-1}"); do
    var="HT_ARGS_$i"
    echo "== host tier run $i: ${!var:-}"
    # shellcheck disable=SC2086
    "$PY" -m lserve.bench.host_tier "$OUT" ${!var:-} 2>&1 | tee "$OUT/host_tier_$i.log"
    rc=$((rc | PIPESTATUS[0]))
done
exit $rc
