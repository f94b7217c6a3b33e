#!/bin/bash
# Session 27: sessions in the router's policy (BENCHMARKS.md 0s). From the repo root.
set -e
export PYTHONPATH=.
OUT=benchmarks/results/s27/router_sim
PY=${PY:-.venv/bin/python}
SWEEP=benchmarks/results/s26/router_sim/sweep.py
SEEDS32=$(seq -s, 0 31)
BASE="--routers prefixserve,sglang-cache-aware,llmd-scorers"
# tight multi-turn (pools at 1/8: 128 pages a replica), every router, 32 seeds at DP 4 and 16, 4 at DP 64
$PY -m benchmarks.router_sim compare --workloads multi-turn --dp 4,16 $BASE --seeds $SEEDS32 --pool-fraction 0.125 \
    --out $OUT/multiturn_tight
$PY -m benchmarks.router_sim compare --workloads multi-turn --dp 64 $BASE --seeds 0,1,2,3 --pool-fraction 0.125 \
    --out $OUT/multiturn_tight_dp64
# ours without the rule (session_growth 0) and the rule's growth factor, same points
{
for dp in 4 16; do
  for growth in 0 2 3 4 6 8; do
    $PY $SWEEP --workload multi-turn --dp $dp --seeds $SEEDS32 --pages 128 --kw "{\"session_growth\": $growth}"
  done
done
$PY $SWEEP --workload multi-turn --dp 64 --seeds 0,1,2,3 --pages 128 --kw '{"session_growth": 0}'
for window in 10 60; do
  $PY $SWEEP --workload multi-turn --dp 4 --seeds $SEEDS32 --pages 128 --kw "{\"session_window_s\": $window}"
done
} > $OUT/knobs.txt
# every published point, as in session 26's all_own (seeds 0-2): nothing may move
$PY -m benchmarks.router_sim compare --workloads sglang-gsp,zipf,multi-turn,llmd-prefix --dp 4,16,64 $BASE \
    --seeds 0,1,2 --out $OUT/all_own
$PY -m benchmarks.router_sim compare --workloads llmd-prefix --dp 4 $BASE --seeds $SEEDS32 --out $OUT/llmd_dp4_own
$PY -m benchmarks.router_sim scale --out $OUT/scale.md
# DP 2 (the real cluster's size on this box), tight, 32 seeds; ours without the rule
$PY -m benchmarks.router_sim compare --workloads multi-turn --dp 2 $BASE --seeds $SEEDS32 --pool-fraction 0.125 \
    --out $OUT/multiturn_tight_dp2
$PY $SWEEP --workload multi-turn --dp 2 --seeds $SEEDS32 --pages 128 --kw '{"session_growth": 0}' > $OUT/knobs_dp2.txt
