"""Decode step times of a short-context batch, in process (no HTTP): 1, 2, 3 and 4 requests of 12 prompt tokens each
decoding together, the median and best wall time of 60 steps per batch size, after 5 warm-up steps. These are the
steps of ``serving_overhead.py``'s streams (and of any chat turn short enough that its linear layers, not attention,
bound a step): the rows of each linear layer are the batch size, so 1-3 rows exercise the small-row kernel and 4 the
packed oneDNN GEMM (on AVX-512 CPUs).

    PYTHONPATH=. .venv/bin/python benchmarks/decode_steps.py --model DIR [--dtype bfloat16] [--threads 1]
        [--prefill-threads N]

``--prefill-threads N``: the engine as a server on a 2-core box runs it (``--num-prefill-threads 2``: prompt steps on
N threads, these decode steps on ``--threads``, one compiled graph for both).
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prefill-threads", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = build_engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=1 << 30,
                                       num_threads=args.threads, num_prefill_threads=args.prefill_threads))
    rng = random.Random(0)
    cells = []
    for batch in (1, 2, 3, 4):
        for index in range(batch):
            prompt = [rng.randrange(100, 8000) for _ in range(12)]
            engine.add_request(EngineRequest(f"b{batch}-{index}", prompt,
                                             SamplingParams(max_tokens=args.steps + 10, temperature=0, ignore_eos=True)))
        for _ in range(5):
            engine.step()
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - started) * 1000)
        cells.append(f"{statistics.median(times):.2f} / {min(times):.2f}")
        for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            engine.abort(seq.request_id)
        while engine.has_work():
            engine.step()
    prefill = f", prefill on {args.prefill_threads}" if args.prefill_threads else ""
    print(f"| {args.dtype}, {args.threads} thread(s){prefill}: median / best ms | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
