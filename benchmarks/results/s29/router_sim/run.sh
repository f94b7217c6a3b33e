#!/bin/bash
# Session 29: new chats stay with their system prompt and a chat's busy home stays a candidate where caches are tight
# (issue 11; BENCHMARKS.md 0u). From the repo root.
set -e
export PYTHONPATH=.
OUT=benchmarks/results/s29/router_sim
PY=${PY:-.venv/bin/python}
SWEEP=benchmarks/results/s26/router_sim/sweep.py
SEEDS32=$(seq -s, 0 31)
BASE="--routers prefixserve,sglang-cache-aware,llmd-scorers"
# tight multi-turn (pools at 1/8: 128 pages a replica), every router, 32 seeds at DP 2, 4 and 16, 4 at DP 64
$PY -m benchmarks.router_sim compare --workloads multi-turn --dp 2,4,16 $BASE --seeds $SEEDS32 --pool-fraction 0.125 \
    --out $OUT/multiturn_tight
$PY -m benchmarks.router_sim compare --workloads multi-turn --dp 64 $BASE --seeds 0,1,2,3 --pool-fraction 0.125 \
    --out $OUT/multiturn_tight_dp64
# the new-chat rule's growth factor (0: off), same points
{
for dp in 2 4 16; do
  for growth in 0 6 8 12; do
    $PY $SWEEP --workload multi-turn --dp $dp --seeds $SEEDS32 --pages 128 --kw "{\"session_start_growth\": $growth}"
  done
done
} > $OUT/knobs.txt
# every published point (seeds 0-2) and llm-d's shared prefix at DP 4 over 32 seeds
$PY -m benchmarks.router_sim compare --workloads sglang-gsp,zipf,multi-turn,llmd-prefix --dp 4,16,64 $BASE \
    --seeds 0,1,2 --out $OUT/all_own
$PY -m benchmarks.router_sim compare --workloads llmd-prefix --dp 4 $BASE --seeds $SEEDS32 --out $OUT/llmd_dp4_own
$PY -m benchmarks.router_sim scale --out $OUT/scale.md
# DP 64 over 16 seeds, ours and llm-d's scorers (4 seeds above are few at this size)
$PY -m benchmarks.router_sim compare --workloads multi-turn --dp 64 --routers prefixserve,llmd-scorers \
    --seeds $(seq -s, 0 15) --pool-fraction 0.125 --out $OUT/multiturn_tight_dp64_16
