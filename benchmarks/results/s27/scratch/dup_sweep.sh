#!/bin/bash
# Scratch: duplicate_page_weight at every simulator point (ours, own eviction), seeds 0-2.
export PYTHONPATH=.
for wl in sglang-gsp zipf multi-turn llmd-prefix; do for dp in 4 16 64; do for w in 0 0.5 1; do
  .venv/bin/python benchmarks/results/s26/router_sim/sweep.py --workload $wl --dp $dp --seeds 0,1,2 --kw "{\"duplicate_page_weight\": $w}"
done; done; done
