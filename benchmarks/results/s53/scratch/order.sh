#!/bin/bash
cd /work/main
helper=${1:-1}
env RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled PREFIXSERVE_STEP_HELPER=$helper setsid .venv/bin/python -m cluster serve \
  --model benchmarks/.scratch/qwen2-896x24 --served-model-name tiny-llama --dtype bfloat16 --kv-cache-page-size 128 \
  --max-model-len 4096 --data-parallel-degree 1 --devices cpu --kv-cache-memory 2GiB --no-enable-disk-cache \
  --host 127.0.0.1 --port 8300 > /tmp/order_server.log 2>&1 &
pid=$!
for _ in $(seq 1 300); do curl -sf --max-time 2 http://127.0.0.1:8300/v1/models > /dev/null && break; sleep 1; done
sc() { .venv/bin/python benchmarks/stream_cpu.py --base-url http://127.0.0.1:8300 --model tiny-llama --streams 1 --output-len 128 --rounds 3 | python3 -c "import json,sys; d=json.load(sys.stdin); print('stream_cpu tpot', d['median_tpot_ms'])"; }
sc; sc
.venv/bin/python benchmarks/serving_overhead.py --base-url http://127.0.0.1:8300 --model tiny-llama --repeats 8 | tr -d '\n '; echo
sc
kill -TERM $pid; for _ in $(seq 1 45); do kill -0 $pid 2>/dev/null || break; sleep 1; done
kill -KILL -- -$pid 2>/dev/null
