"""Where the time of a request whose prefix comes from a shared tier goes, beside the same request on a local hit.

``kv_sources.py`` measures each source's fetch (16 MiB for a 2048-token prefix) and the TTFT of a 2048 + 64 token
request per source; the TTFT gap to the local hit was larger than the fetch (session 23: disk fetch 6.6 ms, TTFT
+14 ms). This script runs the same kind of request on in-process engines (no Ray) and timestamps each phase of the
request path by wrapping the engine's own methods (no product code changes):

    call     generate() called -> AsyncEngine._admit starts on the engine thread (the hop into the engine thread)
    admit    AsyncEngine._admit (plan the request against the cache, start the fetch)
    spawn    admit's end -> PrefixFetcher.fetch starts on the event loop
    load     the tier's load (MGET / file read, verify, decrypt into page tensors) on the fetcher's load thread, or
             the peer client's fetch (--peer: another process's shared pool, as two replicas on one node)
    fetch    the rest of PrefixFetcher.fetch (the hop to the load thread and back)
    to_add   fetch's end -> AsyncEngine._add on the engine thread
    add      AsyncEngine._add (queue the request)
    to_step  -> the engine's step starts
    import   the step's writes of the fetched pages into the pool (LLMEngine._import_pages)
    forward  the rest of the step: schedule, the model's forward over the new tokens, sampling
    deliver  step's end -> the output reaches the caller

Usage:
    python benchmarks/remote_ttft_breakdown.py [--prefix-len 2048] [--suffix-len 64] [--rounds 7] [--dtype bfloat16]
        [--prefill-threads 1] [--peer]

--peer adds a holder process (a Ray actor, as in kv_sources.py) and a mode that copies the prefix out of its shared
pool (copy on, no tier behind it).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import time
from collections import defaultdict

import ray
import torch

from benchmarks.kv_sources import MODEL_DIR, Holder, ensure_model, peer_client, private_redis, tokens
from common.types import EngineRequest, SamplingParams
from replica.async_engine import AsyncEngine
from replica.config import EngineConfig
from replica.engine import LLMEngine, build_engine
from replica.kv_sources import PrefixFetcher, build_tiers, page_format_of
from replica.peer_copy import ServePeerClient

PHASES = ("call", "admit", "spawn", "load", "fetch", "to_add", "add", "to_step", "import", "forward", "deliver")

_marks: list[tuple[str, float, float]] | None = None
"""(label, start, end) of each wrapped call while a request is being timed, else None."""


def _timed(label: str, fn):
    """``fn`` wrapped to append (label, start, end) to ``_marks`` while timing is on."""
    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapped_async(*args, **kwargs):
            start = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                if _marks is not None:
                    _marks.append((label, start, time.perf_counter()))
        return wrapped_async

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if _marks is not None:
                _marks.append((label, start, time.perf_counter()))
    return wrapped


def instrument() -> None:
    AsyncEngine._admit = _timed("admit", AsyncEngine._admit)
    AsyncEngine._add = _timed("add", AsyncEngine._add)
    PrefixFetcher.fetch = _timed("fetch", PrefixFetcher.fetch)
    ServePeerClient.fetch = _timed("load", ServePeerClient.fetch)
    LLMEngine.step = _timed("step", LLMEngine.step)
    LLMEngine._import_pages = _timed("import", LLMEngine._import_pages)


def instrument_tier(tier) -> None:
    tier.load = _timed("load", tier.load)


def phases(called: float, delivered: float, marks: list[tuple[str, float, float]]) -> dict[str, float]:
    """Milliseconds per phase of one request (see the module docstring) from its marks."""
    first = {}
    for label, start, end in marks:
        if label == "step" and "step" in first and first["step"][1] > 0:
            continue  # a step after the one that produced the first token (none with max_tokens=1)
        first.setdefault(label, (start, end))
    admit = first["admit"]
    step = first["step"]
    out = {"call": admit[0] - called, "admit": admit[1] - admit[0]}
    if "fetch" in first:
        fetch = first["fetch"]
        load = first.get("load", (fetch[0], fetch[0]))
        add = first["add"]
        out.update(spawn=fetch[0] - admit[1], load=load[1] - load[0],
                   fetch=(fetch[1] - fetch[0]) - (load[1] - load[0]), to_add=add[0] - fetch[1],
                   add=add[1] - add[0], to_step=step[0] - add[1])
    else:  # a local hit is queued inside admit
        out.update(spawn=0.0, load=0.0, fetch=0.0, to_add=0.0, add=0.0, to_step=step[0] - admit[1])
    imported = first.get("import", (step[0], step[0]))
    out.update(forward=(step[1] - step[0]) - (imported[1] - imported[0]), deliver=delivered - step[1])
    out["import"] = imported[1] - imported[0]
    return {name: value * 1000 for name, value in out.items()}


async def timed_request(engine: AsyncEngine, prompt: list[int], request_id: str,
                        peer_hint: str | None = None) -> tuple[float, dict, dict]:
    global _marks
    _marks = []
    called = time.perf_counter()
    request = EngineRequest(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0), peer_hint=peer_hint)
    async for out in engine.generate(request):
        delivered = time.perf_counter()
        break
    marks, _marks = _marks, None
    return (delivered - called) * 1000, phases(called, delivered, marks), out.cached_tokens.as_dict()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefill-threads", type=int, default=1)
    parser.add_argument("--peer", action="store_true", help="add the shared-pool peer copy (starts Ray)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ensure_model()
    instrument()
    server = private_redis("1gb")
    time.sleep(0.5)
    redis_tcp = f"redis://127.0.0.1:{server.port}/0"
    redis_unix = f"unix://{server.socket}?db=0"

    def config(replica_id: str) -> EngineConfig:
        return EngineConfig(model=str(MODEL_DIR), dtype=args.dtype, kv_cache_memory_bytes=256 << 20,
                            max_num_batched_tokens=4096, max_model_len=4096, replica_id=replica_id,
                            num_prefill_threads=args.prefill_threads)

    holder = None
    if args.peer:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        holder = Holder.remote(config("holder"))

    def make(replica_id: str, redis_url: str | None = None, disk: bool = False, peer: bool = False) -> AsyncEngine:
        engine = build_engine(config(replica_id))
        fmt = page_format_of(engine)
        tiers = build_tiers(fmt, redis_url=redis_url, disk_cache_dir=server.folder if disk else None,
                            disk_budget_bytes=4 << 30) if (redis_url or disk) else []
        for tier in tiers:
            instrument_tier(tier)
        client = peer_client(holder, shared_memory=True) if peer else None
        return AsyncEngine(engine, PrefixFetcher(fmt, tiers=tiers, peer_client=client, own_replica_id=replica_id))

    writer = build_engine(config("writer"))
    writer_tiers = build_tiers(page_format_of(writer), redis_url=redis_tcp, disk_cache_dir=server.folder,
                               disk_budget_bytes=4 << 30)
    modes = {"local hit": make("local"), "Redis, TCP": make("redis-tcp", redis_tcp),
             "Redis, unix socket": make("redis-unix", redis_unix), "disk": make("disk", disk=True)}
    if holder is not None:
        modes["peer, shared pool"] = make("peer", peer=True)
    totals: dict[str, list[float]] = defaultdict(list)
    parts: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in modes}
    sources = {}
    loop = asyncio.new_event_loop()
    try:
        for r in range(args.rounds + 1):  # round 0 warms every engine up and is not counted
            prefix = tokens(args.prefix_len, seed=300 + r)
            writer.add_request(EngineRequest(f"w{r}", prefix, SamplingParams(max_tokens=1, temperature=0.0)))
            while writer.has_work():
                writer.step()
            PrefixFetcher(page_format_of(writer), tiers=writer_tiers).store(writer.export_pages(
                writer.page_keys(prefix)))
            for tier in writer_tiers:
                tier.flush(30)
            if holder is not None:
                ray.get(holder.compute.remote(prefix))
            loop.run_until_complete(timed_request(modes["local hit"], prefix, f"warm-{r}"))
            prompt = prefix + tokens(args.suffix_len, seed=400 + r)
            for name, engine in modes.items():
                total, split, cached = loop.run_until_complete(timed_request(engine, prompt, f"{name}-{r}",
                                                                                 peer_hint="holder"))
                for tier in engine.fetcher.tiers:
                    tier.flush(30)
                if r:
                    totals[name].append(total)
                    for phase, value in split.items():
                        parts[name][phase].append(value)
                    sources[name] = cached
    finally:
        loop.close()
        for engine in modes.values():
            engine.shutdown()
        for tier in writer_tiers:
            tier.close()
        server.close()
        if holder is not None:
            ray.shutdown()

    med = statistics.median
    reference = med(totals["local hit"])
    print(f"\nTTFT of {args.prefix_len} cached + {args.suffix_len} new tokens, {args.dtype}, prefill threads "
          f"{args.prefill_threads}, medians of {args.rounds} rounds (ms); cpu count {os.cpu_count()}\n")
    print("| prefix from | TTFT | / local | " + " | ".join(PHASES) + " | cached tokens |")
    print("|---" * (len(PHASES) + 4) + "|")
    for name in modes:
        row = " | ".join(f"{med(parts[name][phase]):.2f}" for phase in PHASES)
        print(f"| {name} | {med(totals[name]):.1f} | {med(totals[name]) / reference:.2f}x | {row} | "
              f"{sources[name]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
