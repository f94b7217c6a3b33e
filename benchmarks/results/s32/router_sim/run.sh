#!/bin/bash
# Session 32: a chat leaves a home its chats have outgrown for a replica where it fits (issue 11; BENCHMARKS.md 0x).
# From the repo root.
set -e
export PYTHONPATH=.
OUT=benchmarks/results/s32/router_sim
PY=${PY:-.venv/bin/python}
SWEEP=benchmarks/results/s26/router_sim/sweep.py
SEEDS32=$(seq -s, 0 31)
BASE="--routers prefixserve,sglang-cache-aware,llmd-scorers"
# tight multi-turn (pools at 1/8: 128 pages a replica), every router, 32 seeds at DP 2, 4 and 16
$PY -m benchmarks.router_sim compare --workloads multi-turn --dp 2,4,16 $BASE --seeds $SEEDS32 --pool-fraction 0.125 \
    --out $OUT/multiturn_tight
# DP 4 again on seeds 32-63 (its per-seed p99 varies 2-16 s), and DP 64 over 16 seeds, ours and llm-d's scorers
$PY -m benchmarks.router_sim compare --workloads multi-turn --dp 4 --routers prefixserve,llmd-scorers \
    --seeds $(seq -s, 32 63) --pool-fraction 0.125 --out $OUT/multiturn_tight_dp4_more
$PY -m benchmarks.router_sim compare --workloads multi-turn --dp 64 --routers prefixserve,llmd-scorers \
    --seeds $(seq -s, 0 15) --pool-fraction 0.125 --out $OUT/multiturn_tight_dp64_16
# the fill (0: the rule off, session 29's policy)
{
for dp in 2 4 16; do
  for fill in 0 0.8 0.9 1 1.1 1.2; do
    $PY $SWEEP --workload multi-turn --dp $dp --seeds $SEEDS32 --pages 128 --kw "{\"session_move_fill\": $fill}"
  done
done
for fill in 0 1; do
  $PY $SWEEP --workload multi-turn --dp 4 --seeds $(seq -s, 32 63) --pages 128 --kw "{\"session_move_fill\": $fill}"
  $PY $SWEEP --workload multi-turn --dp 64 --seeds $(seq -s, 0 15) --pages 128 --kw "{\"session_move_fill\": $fill}"
done
} > $OUT/knobs.txt
# every published point (seeds 0-2) and llm-d's shared prefix at DP 4 over 32 seeds
$PY -m benchmarks.router_sim compare --workloads sglang-gsp,zipf,multi-turn,llmd-prefix --dp 4,16,64 $BASE \
    --seeds 0,1,2 --out $OUT/all_own
$PY -m benchmarks.router_sim compare --workloads llmd-prefix --dp 4 $BASE --seeds $SEEDS32 --out $OUT/llmd_dp4_own
$PY -m benchmarks.router_sim scale --out $OUT/scale.md
