#!/bin/bash
# Session 29: the new-chat rule (--router-session-start-growth) on a real DP=2 cluster (BENCHMARKS.md 0u). Session
# 27's point (s27/session_real.sh): LMCache's multi-round-qa, 8 users sharing one 1024-token system prompt, each with
# a 512-token history, 10 rounds of a 128-token question and a 64-token answer, 2 requests/s; 64 pages of 1 MiB a
# replica (bf16 tiny Llama), so the chats outgrow the caches. Every user's first prompt holds the shared system prompt
# (8 of its 13 pages): with the rule, new chats start where it is while that replica stays within the load bound.
# Runs alternate the rule off (0) and on (8, the default). Disk tier and Redis off. From the repo root.
OUT=benchmarks/results/s29/start_real
mkdir -p $OUT
PORT=${PORT:-8433}
for seed in ${SEEDS:-0 1}; do
  for start in 0 8; do
    label=start$start-seed$seed
    .venv/bin/prefixserve serve --model benchmarks/.scratch/tiny-llama-512x8 --dtype bfloat16 \
        --data-parallel-degree 2 --kv-cache-memory 64MiB --router-session-start-growth $start \
        --no-enable-disk-cache --port $PORT > $OUT/serve-$label.log 2>&1 &
    server=$!
    for _ in $(seq 120); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
    .venv/bin/prefixserve bench --base-url http://127.0.0.1:$PORT --workload multi-round-qa \
        --num-users 8 --num-rounds 10 --qps 2 --shared-system-prompt 1024 --user-history-prompt 512 \
        --question-len 128 --answer-len 64 --seed $seed --label $label --no-progress \
        --result-file $OUT/$label.json > $OUT/$label.txt 2>&1
    curl -s http://127.0.0.1:$PORT/metrics | grep -E "^prefixserve_router_decisions_total" > $OUT/$label.decisions.txt
    kill -TERM $server; wait $server
  done
done
