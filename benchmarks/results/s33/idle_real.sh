#!/bin/bash
# Session 33: chats taken for ended once idle (--router-session-idle-factor) on a real DP=2 cluster
# (BENCHMARKS.md 0y). Session 29's point (s29/start_real.sh): LMCache's multi-round-qa, 8 users sharing one 1024-token
# system prompt, each with a 512-token history, 10 rounds of a 128-token question and a 64-token answer, 2
# requests/s; 64 pages a replica (128 MiB of float32 tiny Llama pages; session 29's bfloat16 overloaded this
# AVX2-only CPU: 0.26 of the 2 requests/s served, TTFT mean 9.6 s), so the chats outgrow the caches. Runs alternate
# the idle rule off (0) and on (1.5, the default). Disk tier and Redis off. From the repo root. Summary:
# .venv/bin/python benchmarks/results/s29/start_real_summary.py benchmarks/results/s33/idle_real
OUT=${OUT:-benchmarks/results/s33/idle_real}  # first versions: OUT=benchmarks/results/s33/idle_real_q95, ..._q99_first
mkdir -p $OUT
PORT=${PORT:-8433}
for seed in ${SEEDS:-0 1}; do
  for factor in 0 1.5; do
    label=idle$factor-seed$seed
    .venv/bin/prefixserve serve --model benchmarks/.scratch/tiny-llama-512x8 --dtype ${DTYPE:-float32} \
        --data-parallel-degree 2 --kv-cache-memory 128MiB --router-session-idle-factor $factor \
        --no-enable-disk-cache --port $PORT > $OUT/serve-$label.log 2>&1 &
    server=$!
    for _ in $(seq 180); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
    .venv/bin/prefixserve bench --base-url http://127.0.0.1:$PORT --workload multi-round-qa \
        --num-users 8 --num-rounds 10 --qps 2 --shared-system-prompt 1024 --user-history-prompt 512 \
        --question-len 128 --answer-len 64 --seed $seed --label $label --no-progress \
        --result-file $OUT/$label.json > $OUT/$label.txt 2>&1
    curl -s http://127.0.0.1:$PORT/metrics | grep -E "^prefixserve_router_(decisions|session_events)_total" \
        > $OUT/$label.decisions.txt
    kill -TERM $server; wait $server
  done
done
