"""Engine step costs under a prefix_repetition-like load, in process (no HTTP): 4 requests of 1536 shared-prefix +
256 own tokens decoding together, and a step that adds a new request's 256-token suffix against a cached prefix.

    PYTHONPATH=. .venv/bin/python benchmarks/engine_steps.py --model DIR [--dtype bfloat16] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from common.types import EngineRequest, SamplingParams
from replica.config import EngineConfig
from replica.engine import build_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = build_engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=1 << 30,
                                       enforce_eager=args.enforce_eager))
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 8000) for _ in range(1536)] for _ in range(4)]

    def request(index: int, prefix: int) -> EngineRequest:
        prompt = prefixes[prefix] + [rng.randrange(100, 8000) for _ in range(256)]
        return EngineRequest(f"r{index}", prompt, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))

    for index in range(4):
        engine.add_request(request(index, index))
    started = time.perf_counter()
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    print(f"4 cold prefills of 1792 tokens: {time.perf_counter() - started:.2f} s")
    for _ in range(5):
        engine.step()
    started = time.perf_counter()
    for _ in range(20):
        engine.step()
    print(f"decode step, batch 4, context ~1800: {(time.perf_counter() - started) * 50:.1f} ms")
    engine.add_request(request(10, 0))
    started = time.perf_counter()
    engine.step()
    print(f"step with a 256-token suffix prefill (1536 cached) + 4 decodes: {(time.perf_counter() - started) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
