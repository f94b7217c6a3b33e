"""How long an engine takes to build (the embedded default model, dtype auto, prefill on 2 threads) and where the
compiled forward's start-up goes (Dynamo's compile metrics and cache counters).
PYTHONPATH=. .venv/bin/python benchmarks/results/s49/scratch/startup_time.py"""
import time

from torch._dynamo.utils import compile_times, counters

from replica.config import EngineConfig
from replica.engine import build_engine

start = time.perf_counter()
engine = build_engine(EngineConfig(model=None, dtype="auto", num_prefill_threads=2))
print(f"build_engine {time.perf_counter() - start:.1f} s, runner start-up {engine.runner.startup_seconds:.1f} s")
print(compile_times(repr="str", aggregate=True))
for name in ("stats", "aot_autograd", "inductor"):
    print(name, dict(counters[name]))
