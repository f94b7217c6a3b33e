"""The vector units' peak on this CPU, one core: the clock (a chain of dependent integer adds, one a cycle), and how
many 8-wide (ymm) and 16-wide (zmm) float32 FMAs and 16-wide bfloat16 pair dot products (vdpbf16ps) start a second
with 8 independent chains, which is enough to hide their latency on the Zen 4 and Zen 5 EPYCs of BENCHMARKS.md.
A kernel's GFLOP/s divided by these says how far it is from what the core can do: Zen 4 runs a 512-bit FMA or
vdpbf16ps as two 256-bit halves (one a cycle), Zen 5 starts two a cycle.

    PYTHONPATH=. .venv/bin/python benchmarks/vector_peak.py

Builds a small C++ program with the system's g++ (``-march=native``); a CPU without AVX-512 reports the ymm FMA only.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

PROGRAM = r"""
#include <chrono>
#include <cstdio>

template <class F> double per_second(long iterations, int per_iteration, F body) {
  const auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < iterations; ++i) body();
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  return iterations * per_iteration / took.count();
}

#define EIGHT(op, r) op " %%" r "10, %%" r "10, %%" r "0\n\t" op " %%" r "10, %%" r "10, %%" r "1\n\t" \
  op " %%" r "10, %%" r "10, %%" r "2\n\t" op " %%" r "10, %%" r "10, %%" r "3\n\t" \
  op " %%" r "10, %%" r "10, %%" r "4\n\t" op " %%" r "10, %%" r "10, %%" r "5\n\t" \
  op " %%" r "10, %%" r "10, %%" r "6\n\t" op " %%" r "10, %%" r "10, %%" r "7\n\t"
#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7"
#define RATE(op, r) per_second(n / 4, 8, [] { asm volatile(EIGHT(op, r) ::: CLOBBERS); })

int main() {
  const long n = 200000000;
  long x = 0;
  std::printf("clock_ghz %.3f\n", per_second(n, 4, [&] {
    asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  }) / 1e9);
  std::printf("fma_ymm_per_s %.4e\n", RATE("vfmadd231ps", "ymm"));
#if defined(__AVX512F__)
  std::printf("fma_zmm_per_s %.4e\n", RATE("vfmadd231ps", "zmm"));
#endif
#if defined(__AVX512BF16__)
  std::printf("dpbf16_zmm_per_s %.4e\n", RATE("vdpbf16ps", "zmm"));
#endif
  return 0;
}
"""

FLOPS_PER_INSTRUCTION = {"fma_ymm_per_s": 16, "fma_zmm_per_s": 32, "dpbf16_zmm_per_s": 64}


def measure() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        source.write_text(PROGRAM)
        subprocess.run(["g++", "-O2", "-march=native", str(source), "-o", str(binary)], check=True)
        output = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    return {name: float(value) for name, value in (line.split() for line in output.splitlines())}


def main() -> int:
    results = measure()
    clock = results.pop("clock_ghz")
    print(f"clock ~{clock:.2f} GHz (dependent integer adds)")
    print("| instruction | per second, one core | per cycle | GFLOP/s, one core |")
    print("|---|---|---|---|")
    for name, rate in results.items():
        print(f"| {name.removesuffix('_per_s')} | {rate / 1e9:.2f} G | {rate / 1e9 / clock:.2f} "
              f"| {rate * FLOPS_PER_INSTRUCTION[name] / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
