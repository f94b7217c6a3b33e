# Sourced by this folder's scripts: README's server (DP=1 on 2 cores, bf16) on the Qwen2-0.5B shape
# (`MODEL_SHAPE=qwen2-0.5b benchmarks/vs_vllm.sh model`) on port 8300, from the repository root.
#   start_q05 HELPER LOG   PREFIXSERVE_STEP_HELPER=HELPER, output in LOG; returns once /v1/models answers
#   stop_q05               SIGTERM, then its process group's stragglers
cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." || exit 1
Q05_PID=""

start_q05() {
  env RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled PREFIXSERVE_STEP_HELPER="$1" setsid .venv/bin/python -m cluster \
    serve --model benchmarks/.scratch/qwen2-896x24 --served-model-name tiny-llama --dtype bfloat16 \
    --kv-cache-page-size 128 --max-model-len 4096 --data-parallel-degree 1 --devices cpu --kv-cache-memory 2GiB \
    --no-enable-disk-cache --host 127.0.0.1 --port 8300 > "$2" 2>&1 &
  Q05_PID=$!
  for _ in $(seq 1 300); do curl -sf --max-time 2 http://127.0.0.1:8300/v1/models > /dev/null && break; sleep 1; done
}

stop_q05() {
  kill -TERM "$Q05_PID"; for _ in $(seq 1 45); do kill -0 "$Q05_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$Q05_PID" 2>/dev/null
}
