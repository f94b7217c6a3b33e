#!/usr/bin/env bash
# Start-up A/B of the stored forward (session 51): main before it (a git worktree of c3c0eac at /tmp/wt_main with its own
# TORCH_EXTENSIONS_DIR) and the tree, in process (benchmarks/results/s49/scratch/startup_time.py: the embedded
# default model, dtype auto, prefill on 2 threads), taking turns. Usage: startup_ab.sh ROUNDS
set -u
rounds=${1:-3}
probe=benchmarks/results/s49/scratch/startup_time.py
tree=/work/main
# both cache folders share the converted model (~/.cache/prefixserve/models) so that only the stored forward differs
mkdir -p /tmp/s51_store && ln -sfn ~/.cache/prefixserve/models /tmp/s51_store/models
for round in $(seq "$rounds"); do
  # main: inductor's cache warm (its graph is there from earlier runs)
  (cd /tmp/wt_main && TORCH_EXTENSIONS_DIR=/tmp/wt_ext PYTHONPATH=. .venv/bin/python $probe 2>&1 \
     | grep "^build_engine" | sed "s/^/main, warm inductor: /")
  # the tree, its stored forward there (a later start)
  (cd $tree && PREFIXSERVE_CACHE_DIR=/tmp/s51_store PYTHONPATH=. .venv/bin/python $probe 2>&1 \
     | grep "^build_engine" | sed "s/^/tree, stored forward: /")
  # the tree, no stored forward (inductor warm): the first start after an upgrade
  rm -rf /tmp/s51_empty && mkdir -p /tmp/s51_empty && ln -sfn ~/.cache/prefixserve/models /tmp/s51_empty/models
  (cd $tree && PREFIXSERVE_CACHE_DIR=/tmp/s51_empty PYTHONPATH=. .venv/bin/python $probe 2>&1 \
     | grep "^build_engine" | sed "s/^/tree, nothing stored: /")
done
