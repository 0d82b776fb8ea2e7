# Sourced by the device scripts that load the default model (gpu_gates.sh, gpu_eval.sh): puts the
# gguf package (from .whl/) and this checkout's lserve on PYTHONPATH, and joins the model's two
# carried parts (.m1/gg.aa, .m2/gg.ab, or their copies stashed in /tmp/model) into $M.
# Needs PY set; sets PYTHONUNBUFFERED and M, or exits when a part is missing.
export PYTHONUNBUFFERED=1
if ! "$PY" -c "import gguf" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
if ! "$PY" -c "import lserve.kernels.loader" 2>/dev/null; then
    ln -sfn ../kernels lserve/kernels
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
M=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /tmp/model
parts=()
for p in gg.aa gg.ab; do
    for d in .m1 .m2 /tmp/model; do [ -f "$d/$p" ] && { parts+=("$d/$p"); break; }; done
done
[ "${#parts[@]}" -eq 2 ] || { echo "model parts missing: ${parts[*]}"; exit 1; }
cat "${parts[@]}" > "$M" || exit 1
