#!/usr/bin/env bash
# On a CUDA machine: the GPU tests and the benchmarks, in one go.
#   OUT=/some/dir bash scripts/gpu_run.sh            (default OUT: ./gpu_out)
#   PARTS="tests threshold e2e" bash scripts/gpu_run.sh   (default: tests kernels threshold e2e)
# Parts and what they write under $OUT:
#   tests      gpu_tests.log (pytest -m gpu; TESTS=... narrows it)
#   kernels    kernels_h200.{json,png}, kernels_bench.log (one layer: kernels vs SDPA; KERNELS_ARGS adds
#              flags, e.g. "--model qwen2.5-7b" -> kernels_qwen2.5-7b_h200.{json,png}; "--adaptive-budgets resampled
#              --adaptive-only" -> kernels_adaptive_h200.json: per-layer budgets vs uniform, summed over the layers)
#   threshold  threshold_h200.{json,png}, threshold.log (lserve bench profile-threshold; the
#              profile it saves is what the e2e engines then use)
#   pthreshold prefill_threshold_h200.{json,png}, pthreshold.log (lserve bench profile-prefill-threshold:
#              from which prompt length block-sparse prefill pays; PT_ARGS adds flags)
#   e2e        e2e_h200.{json,png}, e2e.log (lserve bench e2e; E2E_ARGS adds flags)
#   sparse     sparse_prefill_h200.{json,png}, sparse_prefill.log (python -m lserve.bench.sparse_prefill:
#              block-sparse prefill attention vs SDPA; SPARSE_ARGS adds flags)
#   bsp        bsp_prefill_h200.{json,png}, bsp_prefill.log (python -m lserve.bench.bsp_prefill: the unified
#              block-sparse prefill kernel, parity then speed at fixed kept fractions; BSP_ARGS adds flags,
#              e.g. "--model qwen2.5-7b" -> bsp_prefill_qwen2.5-7b_h200.{json,png})
#   probe      probe_*.json (bsp_ncu: ncu_*.txt), probe.log (scripts/probes/probe_$PROBE.py: PROBE=decode (default), selector, launch, timeline, bsp_ncu,
#              sdpa, first_prefill or served_prefill; PROBE_ARGS adds flags)
#   profile    profile_*.json, profile.log (kernels of the prefill and eager decode steps by GPU time;
#              PROFILE_ARGS, e.g. "--config lserve --context 32768")
# plus gpu_info.txt, and a short summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
PARTS="${PARTS:-tests kernels threshold e2e}"
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    "$PY" -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__)"
} 2>&1 | tee "$OUT/gpu_info.txt"

rc=0
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has tests; then
    timeout "${TEST_TIMEOUT:-480}" "$PY" -m pytest ${TESTS:-tests/gpu} -m gpu -q -rA --tb=short -p no:cacheprovider \
        -o faulthandler_timeout=300 2>&1 | tee "$OUT/gpu_tests.log"
    test_rc=${PIPESTATUS[0]}; rc=$((rc | (test_rc != 0)))
fi
if has kernels; then
    # shellcheck disable=SC2086
    LSERVE_BENCH_COMMAND="bash scripts/gpu_run.sh  (python -m lserve.bench.kernels \$OUT ${KERNELS_ARGS:-})" \
        timeout "${BENCH_TIMEOUT:-480}" "$PY" -m lserve.bench.kernels "$OUT" ${KERNELS_ARGS:-} 2>&1 | tee "$OUT/kernels_bench.log"
    rc=$((rc | (PIPESTATUS[0] != 0)))
fi
if has threshold; then
    # shellcheck disable=SC2086
    timeout "${THRESHOLD_TIMEOUT:-300}" "$PY" -m lserve bench profile-threshold --out "$OUT" --name threshold_h200 \
        ${THRESHOLD_ARGS:-} 2>&1 | tee "$OUT/threshold.log"
    rc=$((rc | (PIPESTATUS[0] != 0)))
fi
if has pthreshold; then
    # shellcheck disable=SC2086
    timeout "${PT_TIMEOUT:-400}" "$PY" -m lserve bench profile-prefill-threshold --out "$OUT" \
        --name prefill_threshold_h200 ${PT_ARGS:-} 2>&1 | tee "$OUT/pthreshold.log"
    rc=$((rc | (PIPESTATUS[0] != 0)))
fi
if has e2e; then
    # shellcheck disable=SC2086
    timeout "${E2E_TIMEOUT:-570}" "$PY" -m lserve bench e2e --out "$OUT" ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log"
    rc=$((rc | (PIPESTATUS[0] != 0)))
fi
if has sparse; then
    # shellcheck disable=SC2086
    timeout "${SPARSE_TIMEOUT:-420}" "$PY" -m lserve.bench.sparse_prefill "$OUT" ${SPARSE_ARGS:-} 2>&1 | tee "$OUT/sparse_prefill.log"
    rc=$((rc | (PIPESTATUS[0] != 0)))
fi
if has bsp; then
    # shellcheck disable=SC2086
    LSERVE_BENCH_COMMAND="PARTS=bsp bash scripts/gpu_run.sh  (python -m lserve.bench.bsp_prefill \$OUT ${BSP_ARGS:-})" \
        timeout "${BSP_TIMEOUT:-420}" "$PY" -m lserve.bench.bsp_prefill "$OUT" ${BSP_ARGS:-} 2>&1 | tee "$OUT/bsp_prefill.log"
    rc=$((rc | (PIPESTATUS[0] != 0)))
fi

if has probe; then
    # shellcheck disable=SC2086
    timeout "${PROBE_TIMEOUT:-300}" "$PY" "scripts/probes/probe_${PROBE:-decode}.py" "$OUT" ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe.log"
    rc=$((rc | (PIPESTATUS[0] != 0)))
fi
if has profile; then
    # shellcheck disable=SC2086
    timeout "${PROFILE_TIMEOUT:-240}" "$PY" scripts/profile_steps.py "$OUT" ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.log"
    rc=$((rc | (PIPESTATUS[0] != 0)))
fi

echo
if has tests; then
    echo "== GPU tests (rc=$test_rc): $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$OUT/gpu_tests.log" | tail -n 1)"
    grep -E '^(FAILED|ERROR) ' "$OUT/gpu_tests.log" | head -n 20
fi
has kernels && { echo "== kernel benchmark"; sed -n '/^copy bandwidth/,$p' "$OUT/kernels_bench.log"; }
has threshold && { echo "== threshold"; tail -n 1 "$OUT/threshold.log"; }
has pthreshold && { echo "== prefill threshold"; tail -n 1 "$OUT/pthreshold.log"; }
has e2e && { echo "== e2e"; sed -n '/^weight floor/,$p' "$OUT/e2e.log"; }
has sparse && { echo "== sparse prefill"; grep -E '^ *[0-9]+ tau' "$OUT/sparse_prefill.log"; }
has profile && { echo "== profile"; sed -n '/of kernels per step/,$p' "$OUT/profile.log"; }
# The device returns at most 8 files from $OUT: past that, the logs travel as one archive.
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
    (cd "$OUT" && tar czf logs.tar.gz ./*.log gpu_info.txt && rm -f ./*.log gpu_info.txt)
fi
exit $rc
