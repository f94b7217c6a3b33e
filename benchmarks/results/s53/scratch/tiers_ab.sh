#!/bin/bash
# kv_sources.py --tiers-only, s48's head (04110e5, worktree) and main taking turns
out=/work/main/benchmarks/results/s53/tiers_ab.txt
: > $out
for r in 1 2 3; do
  for side in s48 main; do
    if [ $side = s48 ]; then dir=/tmp/wt_s48; ext=/tmp/te_s48; else dir=/work/main; ext=; fi
    echo "== round $r $side" >> $out
    (cd $dir && env ${ext:+TORCH_EXTENSIONS_DIR=$ext} PYTHONPATH=. timeout 900 /work/main/.venv/bin/python benchmarks/kv_sources.py --dtype bfloat16 --rounds 7 --tiers-only 2>&1 | grep "^| Redis\|^| disk\|^| recompute" >> $out)
  done
done
