#!/usr/bin/env bash
# First start with every cache empty (inductor's: a fresh TORCHINDUCTOR_CACHE_DIR; the tree's stored forwards: a fresh
# PREFIXSERVE_CACHE_DIR sharing only the converted model), main (a worktree of c3c0eac at /tmp/wt_main) and the tree
# taking turns, in process (benchmarks/results/s49/scratch/startup_time.py). Usage: startup_cold_ab.sh ROUNDS
set -u
probe=benchmarks/results/s49/scratch/startup_time.py
for round in $(seq "${1:-2}"); do
  rm -rf /tmp/s51_ind && (cd /tmp/wt_main && TORCH_EXTENSIONS_DIR=/tmp/wt_ext TORCHINDUCTOR_CACHE_DIR=/tmp/s51_ind \
    PYTHONPATH=. .venv/bin/python $probe 2>&1 | grep "^build_engine" | sed "s/^/main, every cache empty: /")
  rm -rf /tmp/s51_ind /tmp/s51_empty && mkdir -p /tmp/s51_empty && ln -sfn ~/.cache/prefixserve/models /tmp/s51_empty/models
  (cd /work/main && TORCHINDUCTOR_CACHE_DIR=/tmp/s51_ind PREFIXSERVE_CACHE_DIR=/tmp/s51_empty \
    PYTHONPATH=. .venv/bin/python $probe 2>&1 | grep "^build_engine" | sed "s/^/tree, every cache empty: /")
done
