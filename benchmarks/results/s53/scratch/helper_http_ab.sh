#!/bin/bash
# The Qwen2-0.5B shape served over HTTP (DP=1, 2 cores, bf16) with the step helper on (default) and off
# (PREFIXSERVE_STEP_HELPER=0), taking turns; serving_overhead.py against each: batch-1 stream TPOT, short request.
#   benchmarks/results/s53/scratch/helper_http_ab.sh ROUNDS > out.txt
cd "$(dirname "$0")/../../../.." || exit 1
MODEL=benchmarks/.scratch/qwen2-896x24
for round in $(seq 1 "${1:-2}"); do
  for helper in 1 0; do
    env RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled PREFIXSERVE_STEP_HELPER=$helper setsid .venv/bin/python -m cluster serve \
      --model $MODEL --served-model-name tiny-llama --dtype bfloat16 --kv-cache-page-size 128 --max-model-len 4096 \
      --data-parallel-degree 1 --devices cpu --kv-cache-memory 2GiB --no-enable-disk-cache --host 127.0.0.1 \
      --port 8300 > /tmp/helper_ab_server.log 2>&1 &
    pid=$!
    for _ in $(seq 1 300); do curl -sf --max-time 2 http://127.0.0.1:8300/v1/models > /dev/null && break; sleep 1; done
    printf '{"round": %d, "helper": %d} ' "$round" "$helper"
    .venv/bin/python benchmarks/serving_overhead.py --base-url http://127.0.0.1:8300 --model tiny-llama | tr -d '\n '
    echo
    kill -TERM $pid; for _ in $(seq 1 45); do kill -0 $pid 2>/dev/null || break; sleep 1; done
    kill -KILL -- -$pid 2>/dev/null; sleep 2
  done
done
