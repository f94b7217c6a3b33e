#!/usr/bin/env bash
# start_ps.sh DTYPE [extra args]: prefixserve as vs_vllm.sh starts it, port 8200, log /tmp/ps.log
cd /work/main
D=$1; shift
RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled .venv/bin/python -m cluster serve --model benchmarks/.scratch/tiny-llama-512x8 \
  --served-model-name tiny-llama --dtype $D --kv-cache-page-size 128 --max-model-len 4096 --max-num-batched-tokens 2048 \
  --max-num-seqs 64 --data-parallel-degree 1 --devices cpu --kv-cache-memory 2GiB --no-enable-disk-cache \
  --host 127.0.0.1 --port 8200 --enable-prefix-caching "$@" > /tmp/ps.log 2>&1 &
echo $! > /tmp/ps.pid
for i in $(seq 120); do curl -sf --max-time 2 http://127.0.0.1:8200/v1/models >/dev/null 2>&1 && break; sleep 1; done
echo "ready after $i s"
