"""benchmarks/vector_peak.py builds and runs its probe on this CPU and reports every instruction the CPU has."""

from __future__ import annotations

import shutil

import pytest

from benchmarks import vector_peak
from replica import cpu_kernels


@pytest.mark.skipif(shutil.which("g++") is None or "fma" not in cpu_kernels._cpu_flag_set(),
                    reason="needs g++ and an FMA CPU")
def test_vector_peak_reports_the_clock_and_each_instruction_this_cpu_has():
    results = vector_peak.measure()
    flags = cpu_kernels._cpu_flag_set()
    expected = {"clock_ghz", "fma_ymm_per_s"}
    expected |= {"fma_zmm_per_s"} if "avx512f" in flags else set()
    expected |= {"dpbf16_zmm_per_s"} if "avx512_bf16" in flags else set()
    assert set(results) == expected
    assert all(value > 0 for value in results.values())
