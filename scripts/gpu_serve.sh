#!/usr/bin/env bash
# On the GPU machine: the Ray Serve app under load (lserve bench serve), in one run.
#   bash scripts/device_ray_wheels.sh        (first, on the CPU machine: fills .devcarry/ray)
#   device call: carry [".devcarry"], command "OUT=$OUT bash scripts/gpu_serve.sh"
# The GPU image has no ray: this unpacks the ray 2.60 wheel and installs the wheels the image lacks
# into /tmp/site (../shared/notes/ray-on-the-device.md), then runs
#   python -m lserve bench serve --out $OUT $SERVE_ARGS   -> $OUT/serve_h200.{json,png} + server logs
# PARTS: "serve" (default), plus "tests" to run TESTS (default: the parity tests) first, "smoke" to run
# scripts/serve_smoke.py (the engine as the server builds it, without Ray) before the server.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
PARTS="${PARTS:-serve}"
CARRY=.devcarry/ray
mkdir -p "$OUT" /tmp/site
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
has() { [[ " $PARTS " == *" $1 "* ]]; }
rc=0
if has tests; then
    timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest ${TESTS:-tests/gpu/test_backend_parity.py} -m gpu -q -rA --tb=short \
        -p no:cacheprovider -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25
    rc=$((rc | (PIPESTATUS[0] != 0)))
fi
if has serve; then
    t0=$(date +%s)
    tar xJf "$CARRY/ray.tar.xz" -C /tmp/site || exit 1
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$CARRY"/wheels/*.whl \
        2>&1 | grep -v "^WARNING: Target directory" || true
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export RAY_USAGE_STATS_ENABLED=0 PATH="/tmp/site/bin:$PATH"  # py-spy: stacks of a hung server
    if has smoke; then  # the engine as the server builds it, without Ray
        timeout 240 "$PY" scripts/serve_smoke.py --model llama3-8b --device cuda --backend cupy --pattern random \
            --max-model-len 140000 --max-cache-tokens 300000 ${SMOKE_ARGS:-} 2>&1 | tee "$OUT/serve_smoke.log"
    fi
    "$PY" -c "import ray, ray.serve, fastapi; print('ray', ray.__version__, 'installed in', $(date +%s) - $t0, 's')" || exit 1
    # shellcheck disable=SC2086
    timeout "${SERVE_TIMEOUT:-560}" "$PY" -m lserve bench serve --out "$OUT" ${SERVE_ARGS:-} 2>&1 | tee "$OUT/serve_bench.log"
    rc=$((rc | (PIPESTATUS[0] != 0)))
    # the engine replicas' own logs (Ray keeps them per session)
    tar czf "$OUT/ray_logs.tgz" -C /tmp/ray/session_latest/logs --exclude='*.pb' . 2>/dev/null || true
fi
# The device returns at most 8 files from $OUT: past that, the logs travel as one archive.
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
    (cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
fi
exit $rc
