#!/bin/bash
# The Qwen2-0.5B shape served over HTTP (DP=1, 2 cores, bf16) with the step helper on (default) and off
# (PREFIXSERVE_STEP_HELPER=0), taking turns; serving_overhead.py against each: batch-1 stream TPOT, short request.
#   benchmarks/results/s53/scratch/helper_http_ab.sh ROUNDS > out.txt
source "$(dirname "$0")/q05_server.sh"
for round in $(seq 1 "${1:-2}"); do
  for helper in 1 0; do
    start_q05 $helper /tmp/helper_ab_server.log
    printf '{"round": %d, "helper": %d} ' "$round" "$helper"
    .venv/bin/python benchmarks/serving_overhead.py --base-url http://127.0.0.1:8300 --model tiny-llama | tr -d '\n '
    echo
    stop_q05; sleep 2
  done
done
