# PYTHONPATH=. .venv/bin/python benchmarks/results/s38/scratch/avx2_build.py <benchmarks/prefill_kernel.py arguments>: that benchmark with the kernels built for AVX2 only (-mno-avx512f)
import runpy
import sys
from replica import cpu_kernels
cpu_kernels.CFLAGS = cpu_kernels.CFLAGS + ["-mno-avx512f"]  # the AVX2 build, on this AVX-512 CPU
sys.argv = ["prefill_kernel.py", *sys.argv[1:]]
runpy.run_path("benchmarks/prefill_kernel.py", run_name="__main__")
