#!/bin/bash
# usage: others.sh KW  -> ours on the other workloads, seeds 0-2, vs before
cd "$(git rev-parse --show-toplevel)"
for w in sglang-gsp zipf multi-turn; do for dp in 4 16 64; do
PYTHONPATH=. nice -n 19 /work/main/.venv/bin/python benchmarks/results/s23/router_sim/scratch/sweep.py --workload $w --dp $dp --seeds 0,1,2 --kw "$1"
done; done
