#!/usr/bin/env bash
# Start-up A/B of the vector-ISA probe started while the model loads (session 52): main (a git worktree of 4d75a45 at
# /tmp/wt_main with its own TORCH_EXTENSIONS_DIR) and the tree, in process, taking turns, both with their forwards
# stored (a later start). Usage: isa_ab.sh ROUNDS
set -u
rounds=${1:-3}
probe=benchmarks/results/s49/scratch/startup_time.py
for round in $(seq "$rounds"); do
  (cd /tmp/wt_main && TORCH_EXTENSIONS_DIR=/tmp/wt_ext PYTHONPATH=. .venv/bin/python $probe 2>&1 \
     | grep "^build_engine" | sed "s/^/main: /")
  (cd /work/main && PYTHONPATH=. .venv/bin/python $probe 2>&1 | grep "^build_engine" | sed "s/^/tree: /")
done
