"""Two engines of the same model starting at once with nothing stored (session 51): one compiles and stores the
forward, the other waits on the file's lock and loads it. Run two of these together:
PREFIXSERVE_CACHE_DIR=/tmp/x PYTHONPATH=. .venv/bin/python benchmarks/results/s51/scratch/two_starts.py MODEL NAME"""
import sys
import time

start = time.perf_counter()
from replica.config import EngineConfig  # noqa: E402
from replica.engine import build_engine  # noqa: E402

engine = build_engine(EngineConfig(model=sys.argv[1], dtype="bfloat16", num_prefill_threads=2,
                                   kv_cache_memory_bytes=1 << 28))
runner = engine.runner
print(f"{sys.argv[2]}: built in {time.perf_counter() - start:.1f} s, forward ready in {runner.startup_seconds:.1f} s, "
      f"compiled {runner.num_compiles}, loaded {runner.num_loaded}")
