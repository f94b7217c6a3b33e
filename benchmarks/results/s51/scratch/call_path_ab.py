"""The stored forward's call path against Dynamo's, in one process (session 51): two engines of the same model, one
loading the stored graph (PrecompiledForward), one with PREFIXSERVE_PRECOMPILED_FORWARD=0 (Dynamo's guards and
cache), decode steps of 1 and 4 requests taking turns, step by step. Also the forward call alone (the runner's
inputs prepared once).
PYTHONPATH=. .venv/bin/python benchmarks/results/s51/scratch/call_path_ab.py --model DIR --dtype bfloat16"""
import argparse
import os
import statistics
import time

import torch

from common.types import EngineRequest, SamplingParams
from replica import compile as compile_module
from replica.config import EngineConfig
from replica.engine import build_engine

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--steps", type=int, default=200)
args = parser.parse_args()
torch.set_num_threads(1)
engines = {}
for name, env in (("stored", ""), ("dynamo", "0")):
    os.environ[compile_module.PRECOMPILED_ENV] = env
    compile_module.clear_cache()
    engines[name] = build_engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=1 << 29,
                                              num_threads=1, num_prefill_threads=2))
    runner = engines[name].runner
    print(name, "compiles", runner.num_compiles, "loaded", runner.num_loaded,
          "precompiled", runner._compiled.forward.precompiled is not None)
for batch in (1, 4):
    times = {name: [] for name in engines}
    for name, engine in engines.items():
        for i in range(batch):
            engine.add_request(EngineRequest(f"{batch}-{i}", list(range(100 + i, 112 + i)),
                                             SamplingParams(max_tokens=args.steps + 10, temperature=0.0,
                                                            ignore_eos=True)))
        for _ in range(5):
            engine.step()
    for _ in range(args.steps):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            times[name].append((time.perf_counter() - start) * 1e3)
    for name in engines:
        print(f"batch {batch}, {name}: median {statistics.median(times[name]):.3f} ms, "
              f"best {min(times[name]):.3f} ms")
    for engine in engines.values():
        for i in range(batch):
            engine.abort(f"{batch}-{i}")
        while engine.has_work():
            engine.step()
