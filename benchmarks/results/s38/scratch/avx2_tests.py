# PYTHONPATH=.:tests .venv/bin/python benchmarks/results/s38/scratch/avx2_tests.py -q tests/test_paged_attention.py -p no:cacheprovider: the tests against the AVX2-only build of the kernels
import sys
import pytest
from replica import cpu_kernels
cpu_kernels.CFLAGS = cpu_kernels.CFLAGS + ["-mno-avx512f"]  # the AVX2 build of the kernels, on this AVX-512 CPU
sys.exit(pytest.main(sys.argv[1:]))
