"""Retention benchmark: a few long system prompts kept with a retention priority, by the segmented LRU, or not at all
(plain LRU), under a flood of unique prompts (one replica, in process, no HTTP).

Workload (the same token ids in both modes): ``--num-systems`` system prompts of ``--system-len`` tokens; a stream of
``--num-requests`` requests in which every ``--pinned-every``-th request is "pinned traffic" (one of the system prompts,
round robin, plus a unique ``--suffix-len``-token question) and the rest are unique ``--flood-len``-token prompts. The
pool (``--num-pages``) is too small for the flood to leave the system prompts alone under LRU.

    lru        no retention, plain LRU (``--kv-cache-protected-fraction 0``): the flood evicts the system prompts
               between their uses
    segmented  no retention, the engine's default segmented LRU (``--kv-cache-protected-fraction 0.7``): a system
               prompt reused once is evicted only after the flood's pages, which are never reused
    retention  pinned traffic carries Retention(priority=80, ttl=600 s) for its system prompt (the extension field
               ``prompt_cache_retention``), budget --retention-budget of the pool, on plain LRU

Requests run one at a time (concurrency 1), so TTFT is the engine time from add to the first token (prefill, plus
nothing queued). Three engines built from the same weights run the workload in lockstep, request by request (the
order of the modes rotates from one request to the next), so load from outside the benchmark hits every mode alike;
each round starts from empty caches. Reported per mode: the cached-token rate and TTFT p50 / p99 of the pinned
traffic, the flood's TTFT p50 and cached rate, and evictions by reason / priority.

Usage:
    PYTHONPATH=. python benchmarks/retention_mix.py [--rounds 1] [--num-requests 60] [--dtype float32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.engine_ttft import make_model, tokens  # the same tiny Llama 512 x 8 and token streams
from common.types import EngineRequest, Retention, SamplingParams
from replica.config import EngineConfig
from replica.engine import build_engine

PAGE = 128
MODES = ("lru", "segmented", "retention")


def workload(args) -> list[tuple[str, list[int], int | None]]:
    """(kind, prompt, system index or None) for every request, in order."""
    systems = [tokens(args.system_len, 10 + index) for index in range(args.num_systems)]
    requests = []
    pinned = 0
    for index in range(args.num_requests):
        if index % args.pinned_every == 0:
            system = pinned % args.num_systems
            requests.append(("pinned", systems[system] + tokens(args.suffix_len, 100_000 + index), system))
            pinned += 1
        else:
            requests.append(("flood", tokens(args.flood_len, 200_000 + index), None))
    return requests


def first_token(engine, request: EngineRequest) -> tuple[float, int, int]:
    """(TTFT seconds, cached prompt tokens, prompt tokens) of one request run alone."""
    start = time.perf_counter()
    engine.add_request(request)
    ttft, cached = None, 0
    while engine.has_work():
        for output in engine.step():
            if ttft is None:
                ttft = time.perf_counter() - start
            cached = output.cached_tokens.total
    return ttft, cached, len(request.prompt_token_ids)


def run_lockstep(engines: dict, requests, round_index: int, system_len: int) -> dict[str, dict]:
    """Run the workload on every engine request by request (the modes' order rotating by one each request), so that
    load from outside hits every mode at the same moments."""
    for engine in engines.values():
        assert engine.reset_prefix_cache()
    before = {mode: engine.kv.kv_cache_metrics().evictions for mode, engine in engines.items()}
    results = {mode: {"pinned": [], "flood": []} for mode in engines}
    for index, (kind, prompt, _system) in enumerate(requests):
        order = list(engines)
        for mode in order[index % len(order):] + order[:index % len(order)]:
            retention = None
            if mode == "retention" and kind == "pinned":  # the system prompt is the retained prefix (a breakpoint)
                retention = Retention(priority=80, ttl_s=600.0, num_tokens=system_len)
            request = EngineRequest(f"{mode}-{round_index}-{index}", prompt,
                                    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                    retention=retention)
            results[mode][kind].append(first_token(engines[mode], request))
    runs = {}
    for mode, engine in engines.items():
        after = engine.kv.kv_cache_metrics().evictions
        evictions = {f"{reason}/p{priority}": count - before[mode].get((reason, priority), 0)
                     for (reason, priority), count in after.items()
                     if count - before[mode].get((reason, priority), 0)}
        runs[mode] = {"results": results[mode], "evictions": evictions}
    return runs


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summarize(runs: list[dict]) -> dict:
    summary = {}
    for kind in ("pinned", "flood"):
        rows = [row for run_ in runs for row in run_["results"][kind]]
        # the first use of each system prompt in a run is a cold miss in both modes; all rows are reported
        ttfts = [row[0] for row in rows]
        summary[kind] = {
            "requests": len(rows),
            "cached_rate": sum(row[1] for row in rows) / sum(row[2] for row in rows),
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p99_ms": 1000 * percentile(ttfts, 0.99),
            "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
        }
    evictions: dict[str, int] = {}
    for run_ in runs:
        for name, count in run_["evictions"].items():
            evictions[name] = evictions.get(name, 0) + count
    summary["evictions"] = evictions
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="/tmp/prefixserve-bench-retention-model")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--num-pages", type=int, default=36)
    parser.add_argument("--retention-budget", type=float, default=0.5)
    parser.add_argument("--protected-fraction", type=float, default=EngineConfig.kv_cache_protected_fraction,
                        help="the segmented mode's --kv-cache-protected-fraction")
    parser.add_argument("--num-systems", type=int, default=3)
    parser.add_argument("--system-len", type=int, default=640)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--flood-len", type=int, default=384)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--pinned-every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--compile", action="store_true",
                        help="compile the model (default: eager, so prompts of new lengths pay no compilation)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model_dir = make_model(Path(args.model_dir))
    engines = {}
    for mode in MODES:
        config = EngineConfig(model=str(model_dir), dtype=args.dtype, num_pages=args.num_pages, page_size=PAGE,
                              max_model_len=2048, max_num_batched_tokens=2048, num_threads=1,
                              kv_cache_retention_budget=args.retention_budget, replica_id=mode,
                              kv_cache_protected_fraction=args.protected_fraction if mode == "segmented" else 0.0,
                              enforce_eager=not args.compile)
        engines[mode] = build_engine(config)
    requests = workload(args)
    # warm-up (compilation, allocator): a few requests on each engine, not measured
    for mode, engine in engines.items():
        for index in range(3):
            first_token(engine, EngineRequest(f"warm-{mode}-{index}", tokens(args.flood_len, 999 + index),
                                              SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        started = time.perf_counter()
        for mode, result in run_lockstep(engines, requests, round_index, args.system_len).items():
            runs[mode].append(result)
        print(f"round {round_index}: {time.perf_counter() - started:.1f} s", flush=True)
    summaries = {mode: summarize(mode_runs) for mode, mode_runs in runs.items()}
    print()
    print(f"pool {args.num_pages} pages of {PAGE} tokens, retention budget {args.retention_budget}, segmented LRU's "
          f"protected fraction {args.protected_fraction}; "
          f"{args.num_systems} system prompts x {args.system_len} tokens (+{args.suffix_len}-token question), "
          f"1 in {args.pinned_every} requests; flood {args.flood_len}-token unique prompts; {args.num_requests} "
          f"requests per round, {args.rounds} round(s) in lockstep, {args.dtype}, "
          f"{'compiled' if args.compile else 'eager'}, concurrency 1")
    print()
    print("| mode | pinned cached-token rate | pinned TTFT p50 ms | pinned TTFT p99 ms | flood cached rate "
          "| flood TTFT p50 ms | evictions (reason/priority) |")
    print("|---|---|---|---|---|---|---|")
    for mode in MODES:
        s = summaries[mode]
        evictions = ", ".join(f"{name}: {count}" for name, count in sorted(s["evictions"].items()))
        print(f"| {mode} | {s['pinned']['cached_rate']:.3f} | {s['pinned']['ttft_p50_ms']:.1f} | "
              f"{s['pinned']['ttft_p99_ms']:.1f} | {s['flood']['cached_rate']:.3f} | {s['flood']['ttft_p50_ms']:.1f} "
              f"| {evictions} |")
    lru = summaries["lru"]["pinned"]
    print()
    for mode in MODES[1:]:
        kept = summaries[mode]["pinned"]
        print(f"pinned TTFT p50 lru / {mode} = {lru['ttft_p50_ms'] / kept['ttft_p50_ms']:.2f}x, "
              f"p99 = {lru['ttft_p99_ms'] / kept['ttft_p99_ms']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summaries": summaries}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
