# Sourced by the GPU scripts: make `lserve` importable from this checkout on the device machine.
# lserve.kernels is the kernels/ directory (setuptools package-dir mapping): install editable,
# or, on a throwaway checkout where that fails, link it into place.
PY="${PY:-python3}"
export PYTHONUNBUFFERED=1
export LSERVE_CACHE_DIR="${LSERVE_CACHE_DIR:-/tmp/lserve-cache}"  # the threshold profile lands here
if ! "$PY" -c "import lserve.kernels.loader" 2>/dev/null; then
    "$PY" -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1 || true
fi
if ! "$PY" -c "import lserve.kernels.loader" 2>/dev/null; then
    ln -sfn ../kernels lserve/kernels
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
