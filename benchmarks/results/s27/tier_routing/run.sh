#!/bin/bash
# Session 27: session 10's tier-routing point (BENCHMARKS.md 0b) again, now that the replicas evict by the segmented
# LRU and the router has sessions. llm-d shared prefix x0.5, pools x0.35, a shared host tier of 8192 pages, 3 seeds.
export PYTHONPATH=.
.venv/bin/python -m benchmarks.router_sim compare --workloads llmd-prefix --dp 4,16 --scale 0.5 --cost-model calibrated \
    --routers prefixserve-measured,prefixserve-tier --host-tier-pages 8192 --pool-fraction 0.35 --seeds 0,1,2 \
    --out benchmarks/results/s27/tier_routing/llmd_x05_pool035
