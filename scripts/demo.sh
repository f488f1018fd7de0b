#!/usr/bin/env bash
# The main job, end to end: serve the built-in model (SmolLM2-135M-Instruct, snapkv) on an
# OpenAI-compatible endpoint, answer one chat request through it, then stop the server.
# `make serve` keeps a server running instead.
set -euo pipefail
PORT=${PORT:-8000}
BIN=${BIN:-.venv/bin}
"$BIN/kvsparse" serve --port "$PORT" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $server 2>/dev/null || { echo "the server exited" >&2; exit 1; }
    sleep 1
done
"$BIN/python" - "$PORT" <<'PY'
import sys

from openai import OpenAI

client = OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused")
model = client.models.list().data[0].id
reply = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
    max_tokens=64,
    temperature=0,
)
print(f"\n[{model}] {reply.choices[0].message.content}")
print(f"[usage] {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens")
PY
