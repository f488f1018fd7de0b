#!/usr/bin/env bash
# A separate environment for NVIDIA's kvpress (it needs transformers < 5.3; the engine's
# environment has a newer one). Usage: scripts/kvpress/setup.sh [VENV_DIR]
set -euo pipefail
VENV=${1:-${KVPRESS_VENV:-$HOME/.cache/kvsparse/kvpress-venv}}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q "transformers<5.3" kvpress accelerate gguf sentencepiece
"$VENV/bin/python" -c "import kvpress, transformers, torch; print('kvpress ready:', transformers.__version__, torch.__version__)"
echo "$VENV"
