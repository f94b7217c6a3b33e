#!/bin/bash
# A true first start: the C++ kernels already built (each tree its own extensions dir), inductor's cache empty
out=/work/main/benchmarks/results/s50/startup_cold_ab.txt; : > $out
run() { rm -rf /tmp/ind_cab; (cd $1 && TORCH_EXTENSIONS_DIR=$2 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_cab PYTHONPATH=. .venv/bin/python -c "
import time
t=time.time()
from replica import cpu_kernels; cpu_kernels.load(); print('C++ kernels loaded in', round(time.time()-t,1), 's')
import runpy; runpy.run_path('benchmarks/results/s49/scratch/startup_time.py')" 2>&1 \
  | grep -E "C\+\+ kernels|build_engine|compile_inner|unique_graphs|fxgraph" | sed "s|^|$3 cold$4: |" >> $out); }
for i in 1 2; do
  run /tmp/wt_main /tmp/ext_old "072648c (main)" $i
  run /work/main /root/.cache/torch_extensions/py311_cpu "tree (one graph)" $i
done
echo done >> $out
