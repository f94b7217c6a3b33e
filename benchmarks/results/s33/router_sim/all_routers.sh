#!/bin/bash
# Session 33: every router of the simulator (ours with and without the cost model, round-robin, power of two choices,
# SGLang's cache_aware, llm-d's scorers, Ray's PrefixCacheAffinityRouter, Dynamo's cost) on every published workload
# at DP 4, 16 and 64 (seeds 0-2), and on tight multi-turn (seeds 0-7), with the final policy (issue 11's target:
# ours at or above every baseline on hit rate and p99; BENCHMARKS.md 0y). From the repo root.
set -e
export PYTHONPATH=.
OUT=benchmarks/results/s33/router_sim
PY=${PY:-.venv/bin/python}
$PY -m benchmarks.router_sim compare --workloads sglang-gsp,zipf,multi-turn,llmd-prefix --dp 4,16,64 --seeds 0,1,2 \
    --out $OUT/all_routers
$PY -m benchmarks.router_sim compare --workloads multi-turn --dp 4,16,64 --seeds $(seq -s, 0 7) --pool-fraction 0.125 \
    --out $OUT/multiturn_tight_all_routers
