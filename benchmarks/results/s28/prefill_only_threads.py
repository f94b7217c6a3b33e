"""Session 28: steps that only compute prompts on the prefill thread count (replica/config.py
``PREFILL_ONLY_STEPS_ON_PREFILL_THREADS``), in process, one engine, the rule toggled round by round.

An engine as a DP=1 server on 2 cores runs it (1 thread for decode-size steps, 2 for prefill-size ones). Timed: the
whole request (add, steps until the first token) of a 12-token prompt with 1 output token (the short request of
issue 9), and of an exact repeat of an 1800-token prompt (its last token recomputed over the cached prefix), each on
an otherwise idle engine. Median and min over the rounds.

    git apply benchmarks/results/s28/prefill_only_threads.diff   # the rule, not adopted (BENCHMARKS.md 0t)
    PYTHONPATH=. .venv/bin/python benchmarks/results/s28/prefill_only_threads.py --dtype float32 [--rounds 40]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from common.types import EngineRequest, SamplingParams
from replica import config as engine_config
from replica.config import EngineConfig
from replica.engine import build_engine


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(n)]


def first_token_s(engine, prompt: list[int], tag: str) -> float:
    start = time.perf_counter()
    engine.add_request(EngineRequest(tag, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    while engine.has_work():
        if any(output.new_token_ids for output in engine.step()):
            break
    elapsed = time.perf_counter() - start
    while engine.has_work():
        engine.step()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default="benchmarks/.scratch/tiny-llama-512x8")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = build_engine(EngineConfig(model=args.model_dir, dtype=args.dtype, kv_cache_memory_bytes=1 << 29,
                                       max_num_batched_tokens=2048, max_model_len=4096, num_threads=1,
                                       num_prefill_threads=2))
    long_prompt = tokens(1800, seed=1)
    for index in range(3):  # warm-up, and the long prompt cached
        first_token_s(engine, tokens(12, seed=100 + index), f"warm-{index}")
        first_token_s(engine, long_prompt, f"warm-long-{index}")
    times = {(rule, case): [] for rule in (False, True) for case in ("short", "repeat")}
    for index in range(args.rounds):
        for rule in ((False, True) if index % 2 == 0 else (True, False)):
            engine_config.PREFILL_ONLY_STEPS_ON_PREFILL_THREADS = rule
            times[rule, "short"].append(first_token_s(engine, tokens(12, seed=1000 + 2 * index + rule),
                                                      f"short-{index}-{rule}"))
            times[rule, "repeat"].append(first_token_s(engine, long_prompt, f"repeat-{index}-{rule}"))
    print(f"| {args.dtype}, {args.rounds} rounds | rule off: median (min) ms | rule on | on / off |")
    print("|---|---|---|---|")
    for case, label in (("short", "12-token prompt, 1 token out"), ("repeat", "exact repeat of 1800 tokens")):
        off, on = times[False, case], times[True, case]
        print(f"| {label} | {statistics.median(off) * 1e3:.2f} ({min(off) * 1e3:.2f}) | "
              f"{statistics.median(on) * 1e3:.2f} ({min(on) * 1e3:.2f}) | "
              f"{statistics.median(on) / statistics.median(off):.2f}x |")


if __name__ == "__main__":
    main()
