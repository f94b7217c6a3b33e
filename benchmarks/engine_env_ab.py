"""Decode steps of two engines in one process, built under two values of an environment switch read at start-up
(e.g. ``PREFIXSERVE_PAIR_LINEAR``), stepping in turn: an A/B that this noisy box cannot skew towards one side. For each
batch size, the same 12-token prompts go to both engines; after 5 warm-up steps, each engine's step is timed in turn
``--steps`` times; medians are printed with their ratio.

    PYTHONPATH=. .venv/bin/python benchmarks/engine_env_ab.py --model DIR [--dtype bfloat16] \
        [--env PREFIXSERVE_PAIR_LINEAR --values 1,0] [--batches 1,2,4,8] [--steps 80] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from common.types import EngineRequest, SamplingParams
from replica.config import EngineConfig
from replica.engine import build_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--env", default="PREFIXSERVE_PAIR_LINEAR")
    parser.add_argument("--values", default="1,0")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    values = args.values.split(",")
    if len(values) != 2:
        raise SystemExit("--values takes two values")
    engines = {}
    for value in values:
        os.environ[args.env] = value
        engines[value] = build_engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=1 << 29,
                                                   num_threads=args.threads))
    a, b = values
    print(f"| batch | {args.env}={a} median ms | {args.env}={b} median ms | ratio |")
    print("|---|---|---|---|")
    for batch in (int(n) for n in args.batches.split(",")):
        times: dict[str, list[float]] = {value: [] for value in values}
        for engine in engines.values():
            rng = random.Random(batch)
            for index in range(batch):
                engine.add_request(EngineRequest(
                    f"b{batch}-{index}", [rng.randrange(100, 8000) for _ in range(12)],
                    SamplingParams(max_tokens=args.steps + 10, temperature=0, ignore_eos=True)))
            for _ in range(5):
                engine.step()
        for _ in range(args.steps):
            for value, engine in engines.items():
                started = time.perf_counter()
                engine.step()
                times[value].append((time.perf_counter() - started) * 1000)
        for engine in engines.values():
            while engine.has_work():
                engine.step()
        median = {value: statistics.median(samples) for value, samples in times.items()}
        print(f"| {batch} | {median[a]:.2f} | {median[b]:.2f} | {median[a] / median[b]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
