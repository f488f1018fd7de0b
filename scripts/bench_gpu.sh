#!/usr/bin/env bash
# The GPU benchmarks of docs/benchmarks.md, as steps that can run in one go or one at a time:
#
#   bash scripts/bench_gpu.sh [STEP ...]
#       (default: tests cap24 uncapped serve-snapkv serve-dense kernels hf)
#
#   tests          GPU tests: Triton kernels against the references, the engine on CUDA (and in
#                  its own process, as servers run it)
#   cap24          bench throughput, dense / snapkv / pyramid, GPU memory capped at 24 GB
#   uncapped       bench throughput, dense / snapkv, no cap
#   cap24-fp8      bench throughput, dense / snapkv with FP8 weights (--quantization fp8), 24 GB cap
#   cap24-fp8kv    the same with FP8 weights and an FP8 KV cache (--kv-cache-dtype fp8), plus snapkv
#                  with a third of the layers whole (--full-layers 11 of 32: the shape calibration
#                  finds on SmolLM2)
#   cap24-budgets  bench throughput, snapkv with the calibrated per-layer budgets (SmolLM2's
#                  profile laid onto the 32 layers by depth) at $BUDGET_TARGETS (default 2 3 4)
#                  effective compression, 24 GB cap: the accuracy sweep's operating points
#   serve-snapkv   `kvsparse serve` (24 GB cap) + `kvsparse bench serve` sweep 1/5/10/20/40
#   serve-dense    the same with the dense policy
#   serve-vllm-plugin  the same sweep against `kvsparse serve --engine vllm` (stock vLLM with the
#                  plugin, snapkv, gpu_memory_utilization $GMU); needs vLLM
#                  importable
#   serve-vllm-plugin-fp8 the same with FP8 weights and an FP8 KV cache (--quantization fp8
#                  --kv-cache-dtype fp8)
#   serve-chart    the Ray Serve application as the Helm chart deploys it (scripts/serve_chart.py
#                  run $CHART_CONFIG, rendered beforehand by `serve_chart.py render`) + the same
#                  sweep; per-replica load from Ray's metrics in $OUT/serve_chart.replicas.json
#   rate-snapkv    `kvsparse serve` (24 GB cap) + open-loop load at $RATES requests/s (Poisson)
#   kernels        kernel microbenchmarks (checks every kernel against its reference first)
#   profile        where a step's time goes (profiler): prefills alone, with running decodes and
#                  as a last chunk; decode-only steps
#   decode         decode-only steps whole, async scheduling off and on, against the graph replay
#                  alone; the sampler's cost per step (snapkv at batch 20, dense at batch 13)
#   hf             Hugging Face transformers `generate`, batch 32 (the transformers peer)
#   vllm-cap24     stock vLLM: offline throughput under the same cap, then its concurrency sweep
#   vllm-sweep     stock vLLM: only its concurrency sweep under the same cap
#   vllm-uncapped  stock vLLM: offline throughput, no cap
#   vllm-fp8       stock vLLM with FP8 weights and FP8 KV cache: offline throughput under the cap
#   vllm-plugin    stock vLLM beside the same vLLM with kvsparse's plugin (snapkv, 3 layers whole,
#                  budget 512), offline under the same cap, each in its own process: tok/s, vLLM's
#                  KV blocks, most sequences running and vLLM's free blocks then
#                  (python -m sparse_core.bench.vllm_plugin; $PLUGIN_ARGS: its flags for the
#                  plugin's engine only, e.g. "--plugin-arg enforce_eager=true"; both engines
#                  use vLLM's CUDA graphs by default)
#   vllm-plugin-fp8 the same with FP8 weights and an FP8 KV cache in both engines
#                  (quantization=fp8, kv_cache_dtype=fp8): vLLM fp8/fp8 beside the plugin fp8/fp8
#   prefix-cache   the shared-prefix workload (every prompt starts with the same $SHARED_PREFIX_LEN
#                  tokens, default 3500), FP8 weights + KV, 24 GB cap: snapkv and dense with the
#                  prefix cache (the default), snapkv without it; then unique prompts, snapkv with
#                  and without it (what the cache costs when nothing is shared)
#   decode-eviction snapkv FP8 weights + KV, 24 GB cap, with and without --decode-eviction (a
#                  sparse layer holds at most its budget): 4000/500, then a long output
#                  ($LONG_INPUT_LEN/$LONG_OUTPUT_LEN, default 1000/8000, 32 prompts)
#   vllm-prefix-cache stock vLLM fp8/fp8 with its prefix cache on the same shared-prefix prompts,
#                  and on unique prompts (python -m sparse_core.bench.vllm_plugin --engines stock)
#   chart-workloads the chart's Ray Serve application ($CHART_CONFIG) under the loads users
#                  compare (run_workloads): 64 clients of unique 4000/500 prompts; 64 chats of 4
#                  turns at 32 and 64 conversations
#   vllm-serve-workloads `vllm serve` (stock vLLM fp8/fp8, its default prefix caching, 24 GB:
#                  gpu_memory_utilization $GMU, the chart's max_model_len 8192) under the same loads
#                  from the same load generator
#
# dummy:llama3-8b, 4000 tokens in / 500 out. JSON and logs land in $OUT (default ./out): each
# step's GPU memory peak, its processes together (sparse_core.bench.gpu_watch), in
# $OUT/<step>.gpu_memory.json, and the serve steps' engine step timelines in
# $OUT/<step>.steps.jsonl (--step-log). Run from
# the repository root on a machine with torch + triton (+ transformers for `hf`). The serve steps
# need the serving extra (fastapi, uvicorn) and the openai client. The vLLM steps need stock vLLM
# importable and $VLLM_PEER pointing at the directory of its peer scripts (bench.py, sweep.py).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
NUM_PROMPTS=${NUM_PROMPTS:-128}
CONCURRENCY=${CONCURRENCY:-1,5,10,20,40}
PORT=${PORT:-8000}
MODEL=${MODEL:-dummy:llama3-8b}
SERVE_ARGS=${SERVE_ARGS:---gpu-memory-limit-gb 24 --max-model-len 4608 --max-num-seqs 64}
INPUT_LEN=${INPUT_LEN:-4000}
OUTPUT_LEN=${OUTPUT_LEN:-500}
TOKEN_RANGE=${TOKEN_RANGE:-100:30000}
LOAD_ARGS=${LOAD_ARGS:-}  # more `kvsparse bench serve` flags for the serve steps, e.g. --processes 1
RATES=${RATES:-1,2,3}
NUM_REQUESTS=${NUM_REQUESTS:-30}
# vLLM's gpu_memory_utilization for the 24 GB cap: 0.17 of an H200 (0.30 of an H100 80GB).
GMU=${GMU:-0.17}
mkdir -p "$OUT"

step_tests() {
    python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_triton_kernels.py \
        tests/test_engine_process.py \
        2>&1 | tail -5
}

step_cap24() {
    python3 -m sparse_core.cli bench throughput --policies dense,snapkv,pyramid \
        --gpu-memory-limit-gb 24 --num-prompts "$NUM_PROMPTS" \
        --json "$OUT/throughput_cap24.json" 2>"$OUT/throughput_cap24.log"
}

step_cap24-fp8() {
    python3 -m sparse_core.cli bench throughput --policies dense,snapkv --quantization fp8 \
        --gpu-memory-limit-gb 24 --num-prompts "$NUM_PROMPTS" \
        --json "$OUT/throughput_cap24_fp8.json" 2>"$OUT/throughput_cap24_fp8.log"
}

step_cap24-fp8kv() {
    local fp8="--quantization fp8 --kv-cache-dtype fp8 --gpu-memory-limit-gb 24"
    python3 -m sparse_core.cli bench throughput --policies dense,snapkv $fp8 \
        --num-prompts "$NUM_PROMPTS" --json "$OUT/throughput_cap24_fp8kv.json" \
        2>"$OUT/throughput_cap24_fp8kv.log"
    python3 -m sparse_core.cli bench throughput --policies snapkv --full-layers 11 $fp8 \
        --num-prompts "$NUM_PROMPTS" --json "$OUT/throughput_cap24_fp8kv_third.json" \
        2>"$OUT/throughput_cap24_fp8kv_third.log"
}

step_cap24-budgets() {
    local r
    for r in ${BUDGET_TARGETS:-2 3 4}; do
        python3 -m sparse_core.cli bench throughput --policies snapkv --layer-budgets auto \
            --target-compression "$r" --gpu-memory-limit-gb 24 --num-prompts "$NUM_PROMPTS" \
            --json "$OUT/throughput_cap24_budgets${r}x.json" \
            2>"$OUT/throughput_cap24_budgets${r}x.log"
    done
}

step_uncapped() {
    python3 -m sparse_core.cli bench throughput --policies dense,snapkv --num-prompts "$NUM_PROMPTS" \
        --json "$OUT/throughput_uncapped.json" 2>"$OUT/throughput_uncapped.log"
}

# A server in the background, until server_stop: `kvsparse serve` (policy $1, $SERVE_ARGS), or
# with CHART_CONFIG set the chart's Ray Serve application (its policy is the rendered one), or
# with $VLLM_SERVE set that command (stock vLLM's server). Its log is $OUT/NAME.log; it is ready
# once /health answers.
server_start() {
    local policy=$1 name=$2
    if [ -n "${VLLM_SERVE:-}" ]; then
        # shellcheck disable=SC2086  # VLLM_SERVE is a command line
        $VLLM_SERVE --port "$PORT" >"$OUT/$name.log" 2>&1 &
    elif [ -n "${CHART_CONFIG:-}" ]; then
        python3 scripts/serve_chart.py run "$CHART_CONFIG" --port "$PORT" \
            --step-log "$OUT/$name.steps.jsonl" >"$OUT/$name.log" 2>&1 &
    else
        # shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
        python3 -m service.cli serve --model "$MODEL" --policy "$policy" $SERVE_ARGS --port "$PORT" \
            --step-log "$OUT/$name.steps.jsonl" >"$OUT/$name.log" 2>&1 &
    fi
    server=$!
    poller=
    for _ in $(seq 400); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" \
            2>/dev/null && break
        kill -0 "$server" 2>/dev/null || { echo "server exited:"; tail -20 "$OUT/$name.log"; return 1; }
        sleep 1
    done
    if [ -n "${CHART_CONFIG:-}" ]; then
        python3 -m sparse_core.bench.replica_load --metrics-url http://127.0.0.1:8080/metrics \
            --output "$OUT/$name.replicas.json" &
        poller=$!
    fi
}

server_stop() {
    [ -z "$poller" ] || { kill -INT "$poller"; wait "$poller"; }
    kill -INT "$server"
    for _ in $(seq 30); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
    kill -9 "$server" 2>/dev/null
    wait "$server" 2>/dev/null
    # The chart's Ray cluster outlives a killed driver: stop it, or the next server finds its port.
    # Serve's HAProxy (RAY_SERVE_ENABLE_HA_PROXY=1) outlives `ray stop` and keeps the port too.
    if [ -n "${CHART_CONFIG:-}" ]; then
        ray stop --force >/dev/null 2>&1
        pkill -f "haproxy -db -f /tmp/haproxy-serve" 2>/dev/null
    fi
}

# bench_serve NAME LABEL LOAD_FLAGS...: `kvsparse bench serve` against the running server; the
# report is $OUT/NAME.json.
bench_serve() {
    local name=$1 label=$2
    shift 2
    python3 -m service.cli bench serve --base-url "http://127.0.0.1:$PORT/v1" \
        --token-range "$TOKEN_RANGE" "$@" --label "$label" --output "$OUT/$name.json" \
        2>>"$OUT/$name.log"
}

# The server, the load generator against it, then the server stopped.
# serve_sweep POLICY NAME LOAD_FLAGS...: the report is $OUT/NAME.json.
serve_sweep() {
    local policy=$1 name=$2 status
    shift 2
    server_start "$policy" "$name" || return 1
    # shellcheck disable=SC2086  # LOAD_ARGS is a list of flags
    bench_serve "$name" "kvsparse $policy" "$@" $LOAD_ARGS --input-len "$INPUT_LEN" \
        --output-len "$OUTPUT_LEN"
    status=$?
    server_stop
    return $status
}

# The loads users compare, against one server: closed-loop clients of unique 4000/500 prompts,
# 64 of them (2 prompts each; unique20 and unique40, not in the default list: 20 and 40 clients
# of 3 each), then 64 chats of 4 turns (a 2,000-token document and a 100-token question;
# each later turn sends the conversation so far, the server's 200-token answer and 100 new
# tokens) at 32 conversations at once (2 each) and 64. Each load draws its prompts from a seed
# of its own, so that none finds another's prompts in a prefix cache. $WORKLOADS picks some
# (default: all). Reports $OUT/NAME_<load>.json.
run_workloads() {
    local name=$1 label=$2 load status=0
    local chat="--turns 4 --input-len 2100 --turn-input-len 100 --output-len 200"
    for load in ${WORKLOADS:-unique64 chat32 chat64}; do
        case $load in
        unique64) set -- --seed 1 --concurrency 64 --requests-per-client 2 --input-len 4000 \
            --output-len 500 ;;
        unique20) set -- --seed 4 --concurrency 20 --requests-per-client 3 --input-len 4000 \
            --output-len 500 ;;
        unique40) set -- --seed 5 --concurrency 40 --requests-per-client 3 --input-len 4000 \
            --output-len 500 ;;
        chat32) set -- --seed 2 $chat --concurrency 32 --requests-per-client 2 ;;
        chat64) set -- --seed 3 $chat --concurrency 64 --requests-per-client 1 ;;
        *) echo "unknown load $load"; return 1 ;;
        esac
        bench_serve "${name}_$load" "$label" "$@" || status=1
    done
    return $status
}

step_chart-workloads() {
    local status
    CHART_CONFIG=${CHART_CONFIG:?render it first: scripts/serve_chart.py render DIR --set ...}
    server_start chart chart_workloads || return 1
    run_workloads chart_workloads "kvsparse chart"
    status=$?
    server_stop
    return $status
}

step_vllm-serve-workloads() {
    local status dir
    dir=$(python3 -c "import sys; sys.path.insert(0, '$VLLM_PEER'); import bench
bench.write_model_dir(); print(bench.MODEL_DIR)") || return 1
    # Token-id prompts and vLLM's return_token_ids: the dummy model needs no tokenizer.
    VLLM_SERVE="python3 -m vllm.entrypoints.cli.main serve $dir --served-model-name $MODEL \
        --load-format dummy --skip-tokenizer-init --quantization fp8 --kv-cache-dtype fp8 \
        --gpu-memory-utilization $GMU --max-model-len 8192 --enable-prompt-tokens-details" \
        server_start vllm vllm_serve_workloads || return 1
    run_workloads vllm_serve_workloads "vLLM fp8/fp8"
    status=$?
    server_stop
    return $status
}

step_serve-snapkv() { serve_sweep snapkv serve_snapkv --concurrency "$CONCURRENCY"; }
step_serve-dense() { serve_sweep dense serve_dense --concurrency "$CONCURRENCY"; }
# serve_vllm_plugin NAME [SERVE FLAGS...]: the sweep against `kvsparse serve --engine vllm`.
serve_vllm_plugin() {
    local name=$1
    shift
    SERVE_ARGS="--engine vllm --gpu-memory-utilization $GMU --max-model-len 4608 --max-num-seqs 64 $*" \
        serve_sweep snapkv "$name" --concurrency "$CONCURRENCY"
}
step_serve-vllm-plugin() { serve_vllm_plugin serve_vllm_plugin; }
step_serve-vllm-plugin-fp8() {
    serve_vllm_plugin serve_vllm_plugin_fp8 --quantization fp8 --kv-cache-dtype fp8
}
step_serve-chart() {
    CHART_CONFIG=${CHART_CONFIG:?render it first: scripts/serve_chart.py render DIR --set ...} \
        serve_sweep chart "${CHART_NAME:-serve_chart}" --concurrency "$CONCURRENCY"
}
step_rate-snapkv() {
    serve_sweep snapkv rate_snapkv --request-rate "$RATES" --num-requests "$NUM_REQUESTS"
}

step_kernels() {
    python3 -m sparse_core.bench.kernels 2>&1 | tee "$OUT/kernels.txt" | tail -25
}

step_profile() {
    local args status=0
    : >"$OUT/profile_step.txt"
    # Then a 1,024-token prompt with 20 sequences decoding, whole and as the last chunk after
    # 3,072 cached tokens (chunked prefill's steps); last, decode-only steps (CUDA graphs) at
    # the batch sizes of the serving (C = 20) and capped dense runs.
    for args in "--policy dense" "--policy snapkv" "--policy snapkv --running 40" \
        "--policy dense --prompts 1 --running 13" \
        "--policy snapkv --prompts 1 --input-len 1024 --running 20" \
        "--policy snapkv --prompts 1 --input-len 1024 --context 3072 --running 20" \
        "--policy snapkv --prompts 0 --running 20" "--policy dense --prompts 0 --running 13"; do
        # shellcheck disable=SC2086  # args is a list of flags
        if ! python3 -m sparse_core.bench.profile_step $args 2>&1 \
            | tee -a "$OUT/profile_step.txt" | grep -v -i warn; then
            status=1
        fi
    done
    return $status
}

step_decode() {
    : >"$OUT/decode_step.txt"
    python3 -m sparse_core.bench.decode_step --policy snapkv --running 20 2>&1 \
        | grep -v -i warn | tee -a "$OUT/decode_step.txt" &&
        python3 -m sparse_core.bench.decode_step --policy dense --running 13 2>&1 \
        | grep -v -i warn | tee -a "$OUT/decode_step.txt"
}

step_hf() {
    python3 -m sparse_core.bench.hf_generate --batch-size 32 | tee "$OUT/hf_generate.json"
}

# Stock vLLM under the same 24 GB (gpu_memory_utilization $GMU), the same prompts count.
step_vllm-cap24() {
    python3 "$VLLM_PEER/bench.py" --only a --pa "$NUM_PROMPTS" --gmu-a "$GMU" 2>&1 \
        | tee "$OUT/vllm_cap24.log" \
        | tail -1 >"$OUT/vllm_cap24.json"
    cat "$OUT/vllm_cap24.json"
    step_vllm-sweep
}

step_vllm-sweep() {
    # Its engine logs its shutdown after the JSON line.
    LEVELS=$CONCURRENCY GMU=$GMU python3 "$VLLM_PEER/sweep.py" 2>&1 | tee "$OUT/vllm_sweep.log" \
        | grep '^{"vllm_ttft_sweep"' >"$OUT/vllm_sweep.json"
    cat "$OUT/vllm_sweep.json"
}

step_vllm-fp8() {
    python3 "$VLLM_PEER/bench.py" --only a --pa "$NUM_PROMPTS" --gmu-a "$GMU" --kv-cache-dtype fp8 \
        --quantization fp8 2>&1 | tee "$OUT/vllm_cap24_fp8.log" | tail -1 >"$OUT/vllm_cap24_fp8.json"
    cat "$OUT/vllm_cap24_fp8.json"
}

# vllm_plugin_bench NAME FLAGS...: stock vLLM and the plugin, offline; the report is $OUT/NAME.json.
vllm_plugin_bench() {
    local name=$1
    shift
    # shellcheck disable=SC2086  # PLUGIN_ARGS is a list of flags
    python3 -m sparse_core.bench.vllm_plugin --model "$MODEL" --num-prompts "$NUM_PROMPTS" \
        --gpu-memory-utilization "$GMU" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
        "$@" ${PLUGIN_ARGS:-} --json "$OUT/$name.json" 2>"$OUT/$name.log"
}

step_vllm-plugin() { vllm_plugin_bench vllm_plugin; }
step_vllm-plugin-fp8() {
    vllm_plugin_bench vllm_plugin_fp8 --engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8
}

step_prefix-cache() {
    local fp8="--quantization fp8 --kv-cache-dtype fp8 --gpu-memory-limit-gb 24"
    local shared="--shared-prefix-len ${SHARED_PREFIX_LEN:-3500}"
    # shellcheck disable=SC2086  # flag lists
    python3 -m sparse_core.cli bench throughput --policies snapkv,dense $fp8 $shared \
        --num-prompts "$NUM_PROMPTS" --json "$OUT/prefix_cache_shared.json" \
        2>"$OUT/prefix_cache_shared.log"
    python3 -m sparse_core.cli bench throughput --policies snapkv $fp8 $shared \
        --no-enable-prefix-caching --num-prompts "$NUM_PROMPTS" \
        --json "$OUT/prefix_cache_shared_off.json" 2>"$OUT/prefix_cache_shared_off.log"
    python3 -m sparse_core.cli bench throughput --policies snapkv $fp8 \
        --num-prompts "$NUM_PROMPTS" --json "$OUT/prefix_cache_unique.json" \
        2>"$OUT/prefix_cache_unique.log"
    python3 -m sparse_core.cli bench throughput --policies snapkv $fp8 --no-enable-prefix-caching \
        --num-prompts "$NUM_PROMPTS" --json "$OUT/prefix_cache_unique_off.json" \
        2>"$OUT/prefix_cache_unique_off.log"
}

step_decode-eviction() {
    local fp8="--policies snapkv --quantization fp8 --kv-cache-dtype fp8 --gpu-memory-limit-gb 24"
    local evict name long="--input-len ${LONG_INPUT_LEN:-1000} --output-len ${LONG_OUTPUT_LEN:-8000}"
    for evict in "" --decode-eviction; do
        name=decode_eviction${evict:+_on}
        # shellcheck disable=SC2086  # flag lists
        python3 -m sparse_core.cli bench throughput $fp8 $evict --num-prompts "$NUM_PROMPTS" \
            --json "$OUT/$name.json" 2>"$OUT/$name.log"
        # shellcheck disable=SC2086
        python3 -m sparse_core.cli bench throughput $fp8 $evict $long --num-prompts 32 \
            --max-model-len 9216 --json "$OUT/${name}_long.json" 2>"$OUT/${name}_long.log"
    done
}

step_vllm-prefix-cache() {
    local fp8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8"
    # shellcheck disable=SC2086  # flag lists
    vllm_plugin_bench vllm_prefix_cache_shared --engines stock $fp8 \
        --engine-arg enable_prefix_caching=true --shared-prefix-len "${SHARED_PREFIX_LEN:-3500}"
    # shellcheck disable=SC2086
    vllm_plugin_bench vllm_prefix_cache_unique --engines stock $fp8 \
        --engine-arg enable_prefix_caching=true
}

step_vllm-uncapped() {
    python3 "$VLLM_PEER/bench.py" --only b --pb "$NUM_PROMPTS" 2>&1 | tee "$OUT/vllm_uncapped.log" \
        | tail -1 >"$OUT/vllm_uncapped.json"
    cat "$OUT/vllm_uncapped.json"
}

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tests cap24 uncapped serve-snapkv serve-dense kernels hf)
for step in "${steps[@]}"; do
    echo "== $step ($(date -u +%H:%M:%S))"
    start=$SECONDS
    # The most GPU memory the step's processes hold at once, CUDA contexts included.
    python3 -m sparse_core.bench.gpu_watch --json "$OUT/$step.gpu_memory.json" &
    watch=$!
    "step_$step" || echo "!! step $step failed"
    kill -INT "$watch" 2>/dev/null
    wait "$watch"
    echo "== $step took $((SECONDS - start)) s"
done
