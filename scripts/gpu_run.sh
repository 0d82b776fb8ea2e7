#!/usr/bin/env bash
# On a CUDA machine: the GPU tests and the kernel benchmark, in one go.
#   OUT=/some/dir bash scripts/gpu_run.sh      (default OUT: ./gpu_out)
# Writes $OUT/gpu_tests.log, $OUT/kernels_h200.{json,png}, $OUT/kernels_bench.log,
# $OUT/gpu_info.txt, and prints a short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
PY="${PY:-python3}"
export PYTHONUNBUFFERED=1

# lserve.kernels is the kernels/ directory (setuptools package-dir mapping): install editable,
# or, on a throwaway checkout where that fails, link it into place.
if ! "$PY" -c "import lserve.kernels.loader" 2>/dev/null; then
    "$PY" -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1 || true
fi
if ! "$PY" -c "import lserve.kernels.loader" 2>/dev/null; then
    ln -sfn ../kernels lserve/kernels
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    "$PY" -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__)"
} 2>&1 | tee "$OUT/gpu_info.txt"

timeout "${TEST_TIMEOUT:-480}" "$PY" -m pytest tests/gpu -m gpu -q -rA --tb=short -p no:cacheprovider \
    -o faulthandler_timeout=300 2>&1 | tee "$OUT/gpu_tests.log"
test_rc=${PIPESTATUS[0]}

LSERVE_BENCH_COMMAND="bash scripts/gpu_run.sh  (python -m lserve.bench.kernels \$OUT)" \
    timeout "${BENCH_TIMEOUT:-480}" "$PY" -m lserve.bench.kernels "$OUT" 2>&1 | tee "$OUT/kernels_bench.log"
bench_rc=${PIPESTATUS[0]}

echo
echo "== GPU tests (rc=$test_rc): $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$OUT/gpu_tests.log" | tail -n 1)"
grep -E '^(FAILED|ERROR) ' "$OUT/gpu_tests.log" | head -n 20
echo "== kernel benchmark (rc=$bench_rc)"
sed -n '/^copy bandwidth/,$p' "$OUT/kernels_bench.log"
exit $(( test_rc != 0 || bench_rc != 0 ))
