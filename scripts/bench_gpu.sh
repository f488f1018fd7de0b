#!/usr/bin/env bash
# One GPU session: the GPU tests, then the throughput benchmark (24 GB cap and uncapped) and the
# transformers peer, on dummy:llama3-8b at 4000 in / 500 out. JSON lands in $OUT (default ./out).
# Run from the repository root on a machine with torch + triton + transformers.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_triton_kernels.py 2>&1 | tail -3
python3 -m service.cli bench throughput --policies "${POLICIES:-dense,snapkv,pyramid}" \
    --gpu-memory-limit-gb 24 --num-prompts "${NUM_PROMPTS:-128}" \
    --json "$OUT/throughput_cap24.json" 2>"$OUT/throughput_cap24.log"
python3 -m service.cli bench throughput --policies dense,snapkv \
    --num-prompts "${NUM_PROMPTS:-128}" \
    --json "$OUT/throughput_uncapped.json" 2>"$OUT/throughput_uncapped.log"
python3 -m sparse_core.bench.hf_generate --batch-size 32 | tee "$OUT/hf_generate.json"
