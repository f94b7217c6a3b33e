"""Engine step costs under a prefix_repetition-like load, in process (no HTTP), CPU time of the engine thread (so a
busy box inflates them less than wall time): a cold 1792-token prefill; a batch-4 decode step, 4 requests of
1536-token prefixes (one each) + 256 own tokens; a step that adds a new request's 256-token suffix against a cached
prefix to those 4 decodes; and a batch-8 decode step where pairs of requests share their prefixes.

With ``--compare-aten-decode`` every measurement is repeated, alternating, with the decode rows attended by ATen's
flash kernel run by run (merged by log-sum-exp) instead of the C++ decode kernel (``replica.cpu_kernels``); with
``--compare-generic``, with the device-generic attention path (SDPA over gathered K/V with masks); with
``--compare-small-linear``, with every linear layer on the library's GEMM (MKL for float32, oneDNN for bfloat16) instead
of the small-row kernel (``replica.llama.linear_kernel``; the compiled forward then holds a graph per setting, compiled
in the warm-up round); with ``--prefill-threads N``, steps of 64+ tokens run on N threads (``--num-prefill-threads``)
and ``--compare-prefill-threads`` repeats every measurement with them on ``--threads`` (the graph is compiled on every
CPU, so one graph serves both); with ``--compare-flash-prefill``, with bfloat16 prompt chunks attended by ATen's flash
kernel run by run (merged by log-sum-exp) instead of the AMX prefill kernel (on CPUs with AMX tiles). The paths are
printed side by side, with the first one's time over each other's.
Times are the engine thread's CPU time, except with prefill threads or ``--wall``, where they are wall time (the step's second
thread works while the engine thread waits for it).

    PYTHONPATH=. .venv/bin/python benchmarks/engine_steps.py --model DIR [--dtype bfloat16] [--rounds 3]
        [--compare-aten-decode] [--compare-generic] [--compare-small-linear] [--compare-packed-linear] [--wall]
        [--enforce-eager]
        [--prefill-threads N [--compare-prefill-threads]] [--compare-flash-prefill]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import replica.paged_attention as paged_attention
from replica import cpu_kernels
from common.types import EngineRequest, SamplingParams
from replica.config import EngineConfig
from replica.engine import build_engine

MEASUREMENTS = ("cold prefill 1792", "decode b4", "decode b4 + suffix prefill 256", "4 suffix prefills 256 at once",
                "decode b8 (pairs share)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare-aten-decode", action="store_true")
    parser.add_argument("--compare-flash-prefill", action="store_true")
    parser.add_argument("--compare-generic", action="store_true")
    parser.add_argument("--compare-small-linear", action="store_true")
    parser.add_argument("--compare-packed-linear", action="store_true")
    parser.add_argument("--wall", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--prefill-threads", type=int, default=None)
    parser.add_argument("--compare-prefill-threads", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = build_engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=1 << 30,
                                       enforce_eager=args.enforce_eager, num_threads=args.threads,
                                       num_prefill_threads=args.prefill_threads))
    prefill_split = args.prefill_threads is not None and args.prefill_threads != args.threads
    wall = args.wall or prefill_split
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 8000) for _ in range(1536)] for _ in range(4)]
    counter = iter(range(10**9))

    def add(prompt: list[int], max_tokens: int = 4000) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{next(counter)}", prompt, params))

    def suffixed(prefix: int) -> list[int]:
        return prefixes[prefix] + [rng.randrange(100, 8000) for _ in range(256)]

    def cpu_ms(fn) -> float:
        clock = time.perf_counter if wall else time.thread_time
        started = clock()
        fn()
        return (clock() - started) * 1000

    def prefill_all() -> None:
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                              for s in engine.scheduler.running):
            engine.step()

    def drain() -> None:
        for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            engine.abort(seq.request_id)
        while engine.has_work():
            engine.step()

    def one_round() -> dict[str, float]:
        out = {}
        add([rng.randrange(100, 8000) for _ in range(1792)], max_tokens=1)
        out[MEASUREMENTS[0]] = cpu_ms(engine.step)
        drain()
        for prefix in range(4):
            add(suffixed(prefix))
        prefill_all()
        for _ in range(3):
            engine.step()
        out[MEASUREMENTS[1]] = min(cpu_ms(engine.step) for _ in range(8))
        add(suffixed(0))
        out[MEASUREMENTS[2]] = cpu_ms(engine.step)
        drain()
        for prefix in range(4):  # prefix_repetition's requests in lockstep: four suffixes in one step
            add(suffixed(prefix), max_tokens=1)
        out[MEASUREMENTS[3]] = cpu_ms(engine.step)
        drain()
        for prefix in (0, 1, 2, 3, 0, 1, 2, 3):
            add(suffixed(prefix))
        prefill_all()
        out[MEASUREMENTS[4]] = min(cpu_ms(engine.step) for _ in range(8))
        drain()
        return out

    kernel = cpu_kernels.load()
    runner = engine.runner
    compact = runner._compiled.forward.module if runner._compiled is not None else runner._compact
    linear_kernel = compact.linear_kernel if compact is not None else None
    packed = compact.packed_from_rows if compact is not None else 0

    # name: (_CPU_SEGMENTS, decode kernel, small-row linear kernel, step threads (short, long), AMX prefill kernel,
    #        rows from which linears run on packed oneDNN weights)
    threads = engine._step_threads
    amx = kernel and cpu_kernels.has_amx() and args.dtype == "bfloat16"
    first_name = ("in place, C++ decode" if kernel else "in place") + (", AMX prefill" if amx else "")
    if prefill_split:
        first_name += f", prefill on {args.prefill_threads} threads"
    if packed:
        first_name += f", packed linear from {packed} rows"
    paths = {first_name: (True, kernel, linear_kernel, threads, amx, packed)}
    if args.compare_aten_decode and kernel:
        paths["in place, ATen decode"] = (True, False, linear_kernel, threads, amx, packed)
    if args.compare_generic:
        paths["generic"] = (False, False, linear_kernel, threads, False, packed)
    if args.compare_small_linear and linear_kernel:
        paths["library linear"] = (True, kernel, None, threads, amx, packed)
    if args.compare_prefill_threads and prefill_split:
        paths[f"prefill on {args.threads} thread(s)"] = (True, kernel, linear_kernel, (args.threads, args.threads), amx,
                                                         packed)
    if args.compare_flash_prefill and amx:
        paths["ATen flash prefill"] = (True, kernel, linear_kernel, threads, False, packed)
    if args.compare_packed_linear and packed:
        paths["unpacked linear"] = (True, kernel, linear_kernel, threads, amx, 1 << 40)
        paths["packed from 1 row"] = (True, kernel, linear_kernel, threads, amx, 1)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    for round_index in range(args.rounds + 1):  # round 0 warms up (first use of each shape)
        for name, (segments, decode_kernel, linear_kernel, step_threads, prefill_kernel, from_rows) in paths.items():
            paged_attention._CPU_SEGMENTS = segments
            paged_attention._CPU_DECODE_KERNEL = decode_kernel
            paged_attention._CPU_PREFILL_KERNEL = prefill_kernel
            engine._step_threads = step_threads
            if compact is not None:
                compact.linear_kernel = linear_kernel
                compact.packed_from_rows = from_rows
            measured = one_round()
            if round_index:
                results[name].append(measured)
    first, *others = paths
    header = " | ".join(f"{name} (best of {args.rounds})" for name in paths)
    ratios = "".join(f" {first} / {other} |" for other in others)
    unit = "wall ms" if wall else "CPU ms of the engine thread"
    print(f"| step ({args.dtype}, {unit}) | {header} |{ratios}")
    print("|---|" + "---|" * (2 * len(paths) - 1))
    for measurement in MEASUREMENTS:
        best = {name: min(r[measurement] for r in rounds) for name, rounds in results.items()}
        cells = " | ".join(f"{best[name]:.1f}" for name in paths)
        ratio_cells = "".join(f" {best[first] / best[other]:.2f}x |" for other in others)
        print(f"| {measurement} | {cells} |{ratio_cells}")


if __name__ == "__main__":
    main()
