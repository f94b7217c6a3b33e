#!/bin/bash
# Session 28: is the replicas' eviction what separates ours from llm-d's scorers on tight multi-turn (issue 11)?
# Pools at 1/8, DP 4 and 16, seeds 0-7, each eviction for both routers: own (ours on the segmented LRU, llm-d on
# LRU, as their engines), lru (both), segmented (both). From the repo root (~2 min).
export PYTHONPATH=.
OUT=benchmarks/results/s28/eviction_check
for ev in own lru segmented; do
  .venv/bin/python -m benchmarks.router_sim compare --workloads multi-turn --dp 4,16 \
      --routers prefixserve,llmd-scorers --seeds 0,1,2,3,4,5,6,7 --pool-fraction 0.125 --eviction $ev \
      --out $OUT/$ev > $OUT/$ev.log 2>&1
done
