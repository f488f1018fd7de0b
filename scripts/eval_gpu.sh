#!/usr/bin/env bash
# The full accuracy sweep of docs/accuracy.md on one GPU, in one go:
#
#   OUT=DIR bash scripts/eval_gpu.sh      (or: bash scripts/eval_gpu.sh DIR)
#
#   grid      dense, snapkv, pyramid, streamingllm, random at 2, 4, 8, 16x, every layer
#             compressed; query-aware and query-agnostic
#   profiles  layer profiles at equal effective compression (2x, 2.5x; keeping the calibrated
#             10 of 30 layers whole caps it below 3x): uniform, first 3 full, calibrated, random
#             on the calibrated layers; both settings
#   budgets   calibrated per-layer budgets at 2x, 3x and 4x effective compression beside uniform
#             SnapKV, the binary profile (where it reaches the ratio), PyramidKV, StreamingLLM and
#             random selection on the same budgets; both settings
#   fp8       dense and the calibrated profile (snapkv, the calibrated layers whole, $FP8_RATIOS
#             effective) with bf16 weights and KV, FP8 weights (--quantization fp8), and FP8
#             weights and KV (--kv-cache-dtype fp8); both settings; files fp8-{bf16,fp8,fp8-kv}.*
#   fp8-budgets  the same three number formats for dense and snapkv with the calibrated per-layer
#             budgets at $FP8_BUDGET_RATIOS (default 3,4) effective compression; files
#             fp8-budgets-{bf16,fp8,fp8-kv}.*
#   calibrate-time  (not in the default steps) times `kvsparse calibrate --target-compression
#             2,3,4` on dummy:llama3-8b at 4000-token prompts, every layer probed alone at 2, 4,
#             8 and 16x; writes calibrate_time.log and its profiles under DIR/calibrate-dummy
#   calibrate-budgets  (not in the default steps) recalibrates SmolLM2's per-layer budgets at the
#             GPU's scale: every layer alone at 2, 4, 8 and 16x on 12 4000-token probes per task
#             (seed 1); the profiles replace the shipped ones in this checkout (so a later `budgets` step
#             in the same run measures them) and are copied to DIR/layer_budgets; writes
#             calibrate_budgets.{md,log}. EVAL_CALIBRATE_REFINE=1 adds `--refine` (every layer
#             measured again around each target's allocation; about 4 times the probe runs).
#             EVAL_CALIBRATE_{LENGTHS,SAMPLES,LEVELS,BAND,PROFILE_DIR} shrink it for a check
#             elsewhere (and keep the shipped profiles)
# EVAL_STEPS picks the steps (default: grid profiles budgets fp8), e.g. EVAL_STEPS=calibrate-time.
# All seven tasks, prompts of 1000, 2000, 4000 and 8000 tokens, 10 samples per task and length,
# SmolLM2-135M-Instruct in bfloat16. Writes grid.{json,md,png}, profiles.{json,md,png} and
# eval.log into DIR and prints the summary tables.
#
# The machine needs torch, Triton and transformers, nothing from the network. What it lacks is
# carried in the bundle that scripts/eval_gpu_bundle.sh makes (.bench/eval-bundle); the defaults
# below read it there:
#   KVSPARSE_SMOLLM2_GGUF   the GGUF file; when it is missing but its parts (FILE.part-NN) are
#                           there, they are joined and checked against SHA256SUMS
#   KVSPARSE_EVAL_DATA      the directory holding lee_background.cor
#   PYTHONPATH              the bundle's site/ is prepended (the gguf package)
# Smaller runs (e.g. a check on CPU) through EVAL_LENGTHS, EVAL_SAMPLES, EVAL_TASKS,
# EVAL_POLICIES, EVAL_RATIOS, EVAL_PROFILE_RATIOS, EVAL_BUDGET_RATIOS, EVAL_FP8_RATIOS, EVAL_FP8_BUDGET_RATIOS, EVAL_DEVICE, EVAL_DTYPE, EVAL_KV_CACHE_GB,
# EVAL_MAX_NUM_SEQS, EVAL_MAX_NUM_BATCHED_TOKENS; PYTHON picks the interpreter (python3).
set -euo pipefail
OUT=${1:-${OUT:-}}
[ -n "$OUT" ] || { echo "usage: OUT=DIR $0  or  $0 DIR" >&2; exit 2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."  # relative paths below (and in the variables) are from the repository root

BUNDLE=${EVAL_BUNDLE:-.bench/eval-bundle}
PY=${PYTHON:-python3}
export KVSPARSE_SMOLLM2_GGUF=${KVSPARSE_SMOLLM2_GGUF:-$BUNDLE/model/SmolLM2-135M-Instruct.Q4_1.gguf}
export KVSPARSE_EVAL_DATA=${KVSPARSE_EVAL_DATA:-$BUNDLE/data}
export PYTHONPATH="$BUNDLE/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LENGTHS=${EVAL_LENGTHS:-1000,2000,4000,8000}
SAMPLES=${EVAL_SAMPLES:-10}
TASKS=${EVAL_TASKS:-passkey,niah_single_noise,niah_single_english,niah_multikey,niah_multivalue,variable_tracking,frequent_words}
POLICIES=${EVAL_POLICIES:-dense,snapkv,pyramid,streamingllm,random}
RATIOS=${EVAL_RATIOS:-2,4,8,16}
PROFILE_RATIOS=${EVAL_PROFILE_RATIOS:-2,2.5}
BUDGET_RATIOS=${EVAL_BUDGET_RATIOS:-2,3,4}
FP8_RATIOS=${EVAL_FP8_RATIOS:-2}
FP8_BUDGET_RATIOS=${EVAL_FP8_BUDGET_RATIOS:-3,4}
STEPS=${EVAL_STEPS:-grid profiles budgets fp8}
DEVICE=${EVAL_DEVICE:-cuda}
DTYPE=${EVAL_DTYPE:-bfloat16}
# One engine per (config, length) holds all of that length's prompts in both settings at once
# (140 at most; dense: all 560), in bfloat16 under 30 GB of KV cache.
KV_GB=${EVAL_KV_CACHE_GB:-40}
MAX_SEQS=${EVAL_MAX_NUM_SEQS:-560}
BATCHED=${EVAL_MAX_NUM_BATCHED_TOKENS:-65536}
LOG=$OUT/eval.log
: >"$LOG"

fail() { echo "eval_gpu: $*" >&2; exit 1; }
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

# -- carried files and packages: check everything before the long part ---------------------------
command -v "$PY" >/dev/null || fail "no $PY; set PYTHON to the interpreter that has torch"
# Every step but calibrate-time (the 8B shape with random weights) reads SmolLM2's GGUF file.
needs_smollm2=
for step in $STEPS; do [ "$step" = calibrate-time ] || needs_smollm2=yes; done
if [ -n "$needs_smollm2" ]; then
    "$PY" -c "import gguf" ||
        fail "cannot import gguf (above): run scripts/eval_gpu_bundle.sh and carry $BUNDLE/site, or put gguf on PYTHONPATH"
    gguf_file=$KVSPARSE_SMOLLM2_GGUF
    if [ ! -f "$gguf_file" ]; then
        parts=("$gguf_file".part-*)
        [ -f "${parts[0]}" ] ||
            fail "model file $gguf_file is missing (set KVSPARSE_SMOLLM2_GGUF, or carry $BUNDLE/model)"
        sums=$(dirname "$gguf_file")/SHA256SUMS
        [ -f "$sums" ] || fail "$sums is missing: cannot check the joined model parts"
        log "joining ${#parts[@]} model parts into $gguf_file"
        cat "${parts[@]}" >"$gguf_file.joining"
        mv "$gguf_file.joining" "$gguf_file"
        (cd "$(dirname "$gguf_file")" && sha256sum --quiet -c SHA256SUMS) || {
            rm -f "$gguf_file"
            fail "the joined model does not match SHA256SUMS: a part is missing or truncated (${parts[*]})"
        }
    fi
fi
[ -f "$KVSPARSE_EVAL_DATA/lee_background.cor" ] ||
    fail "$KVSPARSE_EVAL_DATA/lee_background.cor is missing (set KVSPARSE_EVAL_DATA, or carry $BUNDLE/data)"
"$PY" - "$DEVICE" "$needs_smollm2" <<'PY' || fail "environment check failed (above)"
import sys

import torch
import transformers

from sparse_core.models.loader import builtin_model_path

device = sys.argv[1]
if device.startswith("cuda") and not torch.cuda.is_available():
    sys.exit(f"--device {device} but torch {torch.__version__} sees no GPU")
name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
print(f"torch {torch.__version__}, transformers {transformers.__version__}, {name}")
if sys.argv[2]:
    print(f"model {builtin_model_path('smollm2-135m-instruct')}")
PY
plot=yes
"$PY" -c "import matplotlib" 2>/dev/null || {
    plot=
    log "matplotlib is missing: no PNG here; make them elsewhere from the JSON with" \
        "kvsparse eval --results OUT/NAME.json --plot NAME.png"
}

# -- the sweep ------------------------------------------------------------------------------------
common=(--device "$DEVICE" --dtype "$DTYPE" --tasks "$TASKS" --lengths "$LENGTHS"
    --samples "$SAMPLES" --settings query-aware,query-agnostic --max-num-seqs "$MAX_SEQS"
    --kv-cache-memory-gb "$KV_GB" --max-num-batched-tokens "$BATCHED")

run_eval() {
    local name=$1
    shift
    log "$name: kvsparse eval $*"
    local start=$SECONDS
    "$PY" -m sparse_core.cli eval "${common[@]}" "$@" --json "$OUT/$name.json" \
        --markdown "$OUT/$name.md" ${plot:+--plot "$OUT/$name.png"} >>"$LOG" 2> >(tee -a "$LOG" >&2) ||
        fail "$name failed; see $LOG"
    log "$name done in $((SECONDS - start)) s"
}

# The flags of a number format of the fp8 step.
number_format_args() {
    case $1 in
    bf16) ;;
    fp8) echo --quantization fp8 ;;
    fp8-kv) echo --quantization fp8 --kv-cache-dtype fp8 ;;
    esac
}

# run_number_formats NAME EVAL_ARGS...: `kvsparse eval` in bf16, with FP8 weights and with FP8
# weights and KV, as NAME-{bf16,fp8,fp8-kv}.
run_number_formats() {
    local name=$1 format
    shift
    for format in bf16 fp8 fp8-kv; do
        # shellcheck disable=SC2046  # the format's flags are words
        run_eval "$name-$format" "$@" $(number_format_args "$format")
        summaries+=("$name-$format")
    done
}

# `kvsparse calibrate ARGS` as step STEP: its tables in STEP.md, its log in STEP.log (dashes as
# underscores), its wall time logged.
run_calibrate() {
    local step=$1
    shift
    local name=${step//-/_}
    log "$step: kvsparse calibrate $*"
    local start=$SECONDS
    "$PY" -m sparse_core.cli calibrate "$@" >"$OUT/$name.md" \
        2> >(tee -a "$OUT/$name.log" >&2) || fail "$step failed; see $OUT/$name.log"
    log "$step: kvsparse calibrate took $((SECONDS - start)) s"
}

# The calibration at the scale users run it: Llama-3-8B's shape (random weights: the time, not
# the profile, is the point), 4000-token probes of the calibration's tasks, every layer alone.
calibrate_time() {
    local args=(--model dummy:llama3-8b --device "$DEVICE" --dtype "$DTYPE"
        --tasks passkey,niah_single_english,niah_multikey --lengths 4000 --samples 2
        --target-compression 2,3,4 --levels 2,4,8,16 --band-size 1 --max-num-seqs 16
        --kv-cache-memory-gb 40 --profile-dir "$OUT/calibrate-dummy")
    run_calibrate calibrate-time "${args[@]}"
}

# SmolLM2's per-layer budgets from probes at the sweep's scale, as the shipped ones were made:
# every layer alone, 12 probes of 4000 tokens per task.
calibrate_budgets() {
    local shipped=${EVAL_CALIBRATE_PROFILE_DIR:-sparse_core/profiles/layer_budgets/smollm2-135m-instruct}
    local args=(--device "$DEVICE" --dtype "$DTYPE"
        --tasks passkey,niah_single_english,niah_multikey --lengths "${EVAL_CALIBRATE_LENGTHS:-4000}"
        --samples "${EVAL_CALIBRATE_SAMPLES:-12}" --target-compression 2,3,4
        --levels "${EVAL_CALIBRATE_LEVELS:-2,4,8,16}" --band-size "${EVAL_CALIBRATE_BAND:-1}"
        --max-num-seqs 64
        --kv-cache-memory-gb "$KV_GB" --max-num-batched-tokens "$BATCHED" --profile-dir "$shipped")
    if [ "${EVAL_CALIBRATE_REFINE:-0}" = 1 ]; then args+=(--refine); fi
    run_calibrate calibrate-budgets "${args[@]}"
    mkdir -p "$OUT/layer_budgets"
    cp "$shipped"/*.json "$OUT/layer_budgets/"
    log "calibrate-budgets: profiles in $OUT/layer_budgets"
}

start=$SECONDS
summaries=()
for step in $STEPS; do
    case $step in
    grid) run_eval grid --policies "$POLICIES" --ratios "$RATIOS" --full-layers 0 ;;
    profiles) run_eval profiles --profile-comparison --ratios "$PROFILE_RATIOS" ;;
    budgets) run_eval budgets --budget-comparison --ratios "$BUDGET_RATIOS" ;;
    fp8)
        run_number_formats fp8 --policies dense,snapkv --full-layers auto --ratios "$FP8_RATIOS" \
            --match-effective
        ;;
    fp8-budgets)
        run_number_formats fp8-budgets --policies dense,snapkv --layer-budgets auto \
            --ratios "$FP8_BUDGET_RATIOS"
        ;;
    calibrate-time) calibrate_time ;;
    calibrate-budgets) calibrate_budgets ;;
    *) fail "unknown step $step (grid, profiles, budgets, fp8, fp8-budgets, calibrate-time, calibrate-budgets)" ;;
    esac
    case $step in grid | profiles | budgets) summaries+=("$step") ;; esac
done

# -- summary: the first table of each (the two settings side by side) -----------------------------
for name in ${summaries[@]+"${summaries[@]}"}; do
    echo
    echo "== $name ($OUT/$name.md)"
    awk '/^$/ { exit } { print }' "$OUT/$name.md"
done | tee -a "$LOG"
log "sweep done in $((SECONDS - start)) s; files in $OUT: $(cd "$OUT" && echo *)"
