#!/bin/bash
# Session 33: a session idle past its chats' usual gap leaves the books (issue 11; BENCHMARKS.md 0y).
# From the repo root.
set -e
export PYTHONPATH=.
OUT=benchmarks/results/s33/router_sim
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
# the idle factor (0: off, session 32's policy)
{
for dp in 2 4 16; do
  for factor in 0 1 1.5 2 3; do
    $PY $SWEEP --workload multi-turn --dp $dp --seeds $SEEDS32 --pages 128 --kw "{\"session_idle_factor\": $factor}"
  done
done
for factor in 0 1.5; do
  $PY $SWEEP --workload multi-turn --dp 4 --seeds $(seq -s, 32 63) --pages 128 --kw "{\"session_idle_factor\": $factor}"
  $PY $SWEEP --workload multi-turn --dp 64 --seeds $(seq -s, 0 15) --pages 128 --kw "{\"session_idle_factor\": $factor}"
done
} > $OUT/knobs.txt
# every published point (seeds 0-2) and llm-d's shared prefix at DP 4 over 32 seeds
$PY -m benchmarks.router_sim compare --workloads sglang-gsp,zipf,multi-turn,llmd-prefix --dp 4,16,64 $BASE \
    --seeds 0,1,2 --out $OUT/all_own
$PY -m benchmarks.router_sim compare --workloads llmd-prefix --dp 4 $BASE --seeds $SEEDS32 --out $OUT/llmd_dp4_own
$PY -m benchmarks.router_sim scale --out $OUT/scale.md
