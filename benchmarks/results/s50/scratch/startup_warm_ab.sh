#!/bin/bash
# cold then warm start-up of the default model, main's head (/tmp/wt_main: git worktree add /tmp/wt_main 072648c) against the
# tree, alternating; only its warm lines are kept (startup_warm_ab.txt): its cold ones included a rebuild of the C++ kernels
out=/work/main/benchmarks/results/s50/startup_ab.txt; : > $out
run() { (cd $1 && TORCH_EXTENSIONS_DIR=$5 TORCHINDUCTOR_CACHE_DIR=$2 PYTHONPATH=. .venv/bin/python benchmarks/results/s49/scratch/startup_time.py 2>&1 \
  | grep -E "build_engine|compile_inner|bytecode_tracing|compile_file|unique_graphs|fxgraph" | sed "s|^|$3 $4: |" >> $out); }
rm -rf /tmp/ind_old /tmp/ind_new
(cd /tmp/wt_main && TORCH_EXTENSIONS_DIR=/tmp/ext_old PYTHONPATH=. .venv/bin/python -c "from replica import cpu_kernels; print(cpu_kernels.load())")
(cd /work/main && PYTHONPATH=. .venv/bin/python -c "from replica import cpu_kernels; print(cpu_kernels.load())")
run /tmp/wt_main /tmp/ind_old "072648c (main)" cold
run /work/main /tmp/ind_new "tree (one graph)" cold
for i in 1 2 3; do run /tmp/wt_main /tmp/ind_old "072648c (main)" warm$i; run /work/main /tmp/ind_new "tree (one graph)" warm$i; done
echo done >> $out
