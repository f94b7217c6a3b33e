#!/bin/bash
# README's server on the 0.5B shape (bf16), stream_cpu.py with one stream: the CPU each process and thread spends per token
cd /work/main
helper=${1:-1}
env RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled PREFIXSERVE_STEP_HELPER=$helper setsid .venv/bin/python -m cluster serve \
  --model benchmarks/.scratch/qwen2-896x24 --served-model-name tiny-llama --dtype bfloat16 --kv-cache-page-size 128 \
  --max-model-len 4096 --data-parallel-degree 1 --devices cpu --kv-cache-memory 2GiB --no-enable-disk-cache \
  --host 127.0.0.1 --port 8300 > /tmp/stream_cpu_server.log 2>&1 &
pid=$!
for _ in $(seq 1 300); do curl -sf --max-time 2 http://127.0.0.1:8300/v1/models > /dev/null && break; sleep 1; done
.venv/bin/python benchmarks/stream_cpu.py --base-url http://127.0.0.1:8300 --model tiny-llama --streams 1 --output-len 256 --rounds 2
kill -TERM $pid; for _ in $(seq 1 45); do kill -0 $pid 2>/dev/null || break; sleep 1; done
kill -KILL -- -$pid 2>/dev/null
