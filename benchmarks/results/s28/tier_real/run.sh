#!/bin/bash
# Session 28: routing on the disk tier's contents with peer copy off, on a real DP=2 cluster (issue 12; BENCHMARKS.md
# 0t). Ours with --no-enable-dp-cross-replica-prefix-copy and the disk tier on, tier-priced (the default with copy off)
# against tier-blind (--no-route-on-tier-contents); the Zipf(1.5) point of section 0e (8 system prompts of 1024
# tokens, 200 requests, 8 in flight, 40 pages per replica), float32, 1 CPU per replica; seeds 0 and 1, 2 runs each,
# interleaved. From the repo root, on a quiet box (~5 min).
OUT=benchmarks/results/s28/tier_real
for seed in 0 1; do
  PYTHONPATH=. .venv/bin/python benchmarks/router_compare.py --routers tier-nocopy,blind-nocopy --repeats 2 \
      --workload zipf --num-requests 200 --concurrency 8 --model-dir benchmarks/.scratch/tiny-llama-512x8 \
      --dtype float32 --num-cpus-per-replica 1 --seed $seed --out $OUT/router_compare_tier_nocopy_seed$seed.md
done
PYTHONPATH=. .venv/bin/python benchmarks/router_compare_percentiles.py $OUT/router_compare_tier_nocopy_seed*.json \
    > $OUT/percentiles.txt
