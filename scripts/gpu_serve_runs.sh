#!/usr/bin/env bash
# On the GPU machine: several `lserve bench serve` runs in one device call (each its own server
# start and flags), so one machine start serves them all.
#   device call: carry [".devcarry/ray"], command
#   OUT=$OUT SERVE_RUNS=2 SERVE_ARGS_1="..." SERVE_ARGS_2="..." bash scripts/gpu_serve_runs.sh
# Run i writes under $OUT/run$i (scripts/gpu_serve.sh); its JSON and PNGs come back at the top of
# $OUT, everything else (logs, Ray logs) in one archive: the device returns at most 8 files.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
rc=0
for i in $(seq 1 "${SERVE_RUNS:-1}"); do
    var="SERVE_ARGS_$i"
    echo "== serve run $i: ${!var:-}"
    OUT="$OUT/run$i" SERVE_ARGS="${!var:-}" bash scripts/gpu_serve.sh
    rc=$((rc | $?))
done
(cd "$OUT" && mv run*/*.json run*/*.png . 2>/dev/null; tar czf serve_logs.tgz run* && rm -rf run*)
exit $rc
