#!/bin/bash
# Session 27: the router's session rule on a real DP=2 cluster (BENCHMARKS.md 0s). LMCache's multi-round-qa, scaled:
# 8 users share a 1024-token system prompt, each with a 512-token history, 10 rounds of a 128-token question and a
# 64-token answer, 2 requests/s overall (a user's rounds >= 4 s apart). A chat ends at ~27 pages of 128 tokens; each
# replica has 64 pages of 1 MiB (bf16 tiny Llama), so its 4 chats (~110 pages) outgrow it, as in the simulator's tight
# multi-turn. Disk tier and Redis off. Runs alternate the rule off (--router-session-growth 0) and on (4). From the
# repo root.
OUT=benchmarks/results/s27/session_real
mkdir -p $OUT
PORT=${PORT:-8433}
for seed in ${SEEDS:-0 1}; do
  for growth in 0 4; do
    label=growth$growth-seed$seed
    .venv/bin/prefixserve serve --model benchmarks/.scratch/tiny-llama-512x8 --dtype bfloat16 \
        --data-parallel-degree 2 --kv-cache-memory 64MiB --router-session-growth $growth \
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
