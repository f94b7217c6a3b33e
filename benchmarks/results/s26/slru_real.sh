#!/bin/bash
# Session 26: the segmented LRU on a real DP=2 cluster (BENCHMARKS.md 0r). SGLang's generated-shared-prefix, scaled:
# 6 groups x 10 prompts (shuffled), 1024-token system prompts + 384-token questions, 16 out, 4 in flight. Each replica
# has 64 pages of 1 MiB (bf16 tiny Llama): its share of the prefixes (3 x 8 pages) plus 2 running requests x 11 pages
# is ~73% of it, llm-d's memory-tight ratio. Disk tier and Redis off: an evicted prefix is recomputed or copied.
# Runs alternate plain LRU (fraction 0) and the segmented LRU (0.7), two seeds. From the repo root.
# Second point (SLRU_POINT=tight): 12 groups x 5 prompts, 1024 + 768 tokens, 108 pages per replica: each replica's
# share of the prefixes (6 x 8 pages) plus two running requests (15 pages each) is again ~73% of its pages, but the
# question pages that pass between two uses of a prefix (~6 requests x 6 pages) exceed the room the prefixes leave.
if [ "${SLRU_POINT:-mild}" = tight ]; then
  OUT=benchmarks/results/s26/slru_real_tight; NUM_GROUPS=12; PER_GROUP=5; QLEN=768; MEM=108MiB
else
  OUT=benchmarks/results/s26/slru_real; NUM_GROUPS=6; PER_GROUP=10; QLEN=384; MEM=64MiB
fi
mkdir -p $OUT
PORT=${PORT:-8431}
for seed in ${SEEDS:-0 1}; do
  for fraction in 0 0.7; do
    label=frac$fraction-seed$seed
    .venv/bin/prefixserve serve --model benchmarks/.scratch/tiny-llama-512x8 --dtype bfloat16 \
        --data-parallel-degree 2 --kv-cache-memory $MEM --kv-cache-protected-fraction $fraction \
        --no-enable-disk-cache --port $PORT > $OUT/serve-$label.log 2>&1 &
    server=$!
    for _ in $(seq 120); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
    .venv/bin/prefixserve bench --base-url http://127.0.0.1:$PORT --workload generated-shared-prefix \
        --gsp-num-groups $NUM_GROUPS --gsp-prompts-per-group $PER_GROUP --gsp-system-prompt-len 1024 \
        --gsp-question-len $QLEN \
        --gsp-output-len 16 --num-requests 60 --concurrency 4 --seed $seed --label $label --no-progress \
        --result-file $OUT/$label.json > $OUT/$label.txt 2>&1
    kill -TERM $server; wait $server
  done
done
