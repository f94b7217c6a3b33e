"""benchmarks/vector_peak.py builds and runs its probe on this CPU and reports every instruction the CPU has."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

PEAK_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "vector_peak.py"


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(shutil.which("g++") is None or "fma" not in cpu_flags(), reason="needs g++ and an FMA CPU")
def test_vector_peak_reports_the_clock_and_each_instruction_this_cpu_has():
    spec = importlib.util.spec_from_file_location("vector_peak", PEAK_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.measure()
    flags = cpu_flags()
    expected = {"clock_ghz", "fma_ymm_per_s"}
    expected |= {"fma_zmm_per_s"} if "avx512f" in flags else set()
    expected |= {"dpbf16_zmm_per_s"} if "avx512_bf16" in flags else set()
    assert set(results) == expected
    assert all(value > 0 for value in results.values())
