"""The engine's side of a short request in process: a 12-token prompt, 1 output token, on the engine the server
builds (the tiny Llama as vs_vllm.sh serves it), timed per request and per phase of ``LLMEngine.step``; then a
cProfile of 300 such requests (cumulative time of the heaviest calls).

    PYTHONPATH=. .venv/bin/python benchmarks/results/s43/scratch/short_step.py [bfloat16] [--profile]
"""
import cProfile
import pstats
import statistics
import sys
import time

import torch

from common.types import EngineRequest, SamplingParams
from replica.config import EngineConfig
from replica.engine import build_engine

MODEL = "benchmarks/.scratch/tiny-llama-512x8"


def main():
    dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
    config = EngineConfig(model=MODEL, dtype=dtype, kv_cache_memory_bytes=2 << 30, max_num_batched_tokens=2048,
                          max_model_len=4096, max_num_seqs=64, replica_id="short")
    engine = build_engine(config)
    gen = torch.Generator().manual_seed(0)

    def one(i):
        prompt = torch.randint(100, 8000, (12,), generator=gen).tolist()
        engine.add_request(EngineRequest(f"s{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0)))
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        return steps

    for i in range(50):
        one(i)
    for rnd in range(3):
        times = []
        for i in range(200):
            start = time.perf_counter()
            one(1000 * (rnd + 1) + i)
            times.append(time.perf_counter() - start)
        print(f"{dtype} 12 in / 1 out, in process: median {statistics.median(times) * 1000:.2f} ms, "
              f"min {min(times) * 1000:.2f} ms")
    if "--profile" in sys.argv:
        profile = cProfile.Profile()
        profile.enable()
        for i in range(300):
            one(10_000 + i)
        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
