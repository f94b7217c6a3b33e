#!/bin/bash
# Session 26: the segmented LRU in the simulator (commands behind BENCHMARKS.md section 0r). From the repo root.
set -e
export PYTHONPATH=.
OUT=benchmarks/results/s26/router_sim
PY=${PY:-.venv/bin/python}
SEEDS32=$(seq -s, 0 31)
BASE="--routers prefixserve,sglang-cache-aware,llmd-scorers"
$PY -m benchmarks.router_sim compare --workloads llmd-prefix --dp 4 $BASE --seeds $SEEDS32 --out $OUT/llmd_dp4_own
$PY -m benchmarks.router_sim compare --workloads llmd-prefix --dp 4 $BASE --seeds $SEEDS32 --eviction segmented \
    --out $OUT/llmd_dp4_segmented
# The "before" (plain LRU, the policy's eviction weight 1.0) was run at 65aef78, before the weight became 0.5:
#   $PY -m benchmarks.router_sim compare --workloads llmd-prefix --dp 4 --routers prefixserve --seeds $SEEDS32 \
#       --eviction lru --out $OUT/llmd_dp4_ours_lru
$PY -m benchmarks.router_sim compare --workloads llmd-prefix --dp 4 --scale 0.5 $BASE --seeds 0,1,2 --out $OUT/llmd_half_dp4_own
$PY -m benchmarks.router_sim compare --workloads sglang-gsp,zipf,multi-turn,llmd-prefix --dp 4,16,64 $BASE \
    --seeds 0,1,2 --out $OUT/all_own
$PY -m benchmarks.router_sim compare --workloads sglang-gsp,zipf,multi-turn,llmd-prefix --dp 4,16,64 $BASE \
    --seeds 0,1,2 --eviction segmented --out $OUT/all_segmented
$PY -m benchmarks.router_sim compare --workloads multi-turn --dp 4 $BASE --seeds 0,1,2 --pool-fraction 0.125 \
    --out $OUT/multiturn_tight_own
$PY -m benchmarks.router_sim compare --workloads multi-turn --dp 4 --routers prefixserve --seeds 0,1,2 \
    --pool-fraction 0.125 --eviction lru --out $OUT/multiturn_tight_ours_lru
