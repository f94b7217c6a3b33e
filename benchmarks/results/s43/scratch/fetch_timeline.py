"""Where a remote-prefix request's time goes, past the local hit: a timeline of one request per source (2048 cached +
64 new tokens), each step stamped with perf_counter in the reader process; "ttft" is when the caller has the first
output (the stamps after it ran while asyncio.run closed the generator). Sources: the local hit, the holder's page
stream (another process, learned), its shared pool, the disk tier, Redis; with and without Redis behind the peer.

    PYTHONPATH=. .venv/bin/python benchmarks/results/s43/scratch/fetch_timeline.py [bfloat16] [rounds]
"""
from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

import ray
import torch

from benchmarks import kv_sources as ks
from replica import async_engine as ae_mod
from replica.async_engine import AsyncEngine
from replica.kv_sources import PrefixFetcher, build_tiers, page_format_of

MARKS: list[tuple[str, float]] = []


def mark(name):
    MARKS.append((name, time.perf_counter()))


def wrap(obj, attr, name, is_async):
    original = getattr(obj, attr)
    if is_async:
        async def wrapper(*a, **k):
            mark(f"{name}>")
            try:
                return await original(*a, **k)
            finally:
                mark(f"{name}<")
    else:
        def wrapper(*a, **k):
            mark(f"{name}>")
            try:
                return original(*a, **k)
            finally:
                mark(f"{name}<")
    setattr(obj, attr, wrapper)


def main():
    dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6

    class Args:
        pass
    args = Args()
    args.dtype, args.prefix_len, args.suffix_len = dtype, 2048, 64
    torch.set_num_threads(1)
    ks.ensure_model()
    server = ks.private_redis("1gb")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    holder = ks.Holder.remote(ks.engine_config(args, "holder"))
    redis_url = f"redis://127.0.0.1:{server.port}/0"
    wrap(AsyncEngine, "_admit", "admit", False)
    wrap(AsyncEngine, "_run_fetch", "fetch", True)
    wrap(AsyncEngine, "_collect", "collect", True)
    wrap(AsyncEngine, "_add", "add", False)
    wrap(PrefixFetcher, "_fetch_from_peer", "peer", True)
    wrap(ae_mod, "coalesce_pending", "out", False)
    wrap(ae_mod, "run_deferred", "deferred", False)
    wrap(PrefixFetcher, "_fetch_from_tier", "tier", True)

    def make(rid, peer=None, redis=None, disk=False):
        engine = ks.build_engine(ks.engine_config(args, rid))
        fmt = page_format_of(engine)
        tiers = build_tiers(fmt, redis_url=redis, disk_cache_dir=server.folder if disk else None,
                            disk_budget_bytes=4 << 30) if (redis or disk) else []
        client = ks.peer_client(holder, shared_memory=peer == "shared", stream=peer == "stream") if peer else None
        return AsyncEngine(engine, PrefixFetcher(fmt, tiers=tiers, peer_client=client, own_replica_id=rid))

    only = os.environ.get("MODES")
    modes = {"local": make("m0"), "stream+redis": make("m1", "stream", redis_url), "stream": make("m2", "stream"),
             "store": make("m6", "store"), "first-ask": make("m7", "stream"),
             "shared": make("m3", "shared"), "disk": make("m4", disk=True), "redis": make("m5", redis=redis_url)}
    if only:
        modes = {name: eng for name, eng in modes.items() if name in only.split(",") or name == "local"}
    reader = ks.build_engine(ks.engine_config(args, "reader"))
    fmt = page_format_of(reader)
    host, disk = build_tiers(fmt, redis_url=redis_url, disk_cache_dir=server.folder, disk_budget_bytes=4 << 30)
    lines = {name: [] for name in modes}
    for r in range(rounds + 1):
        prefix = ks.tokens(2048, seed=300 + r)
        ray.get(holder.compute.remote(prefix))
        keys = reader.page_keys(prefix)
        pages = ks.unbundle_pages(ray.get(holder.export.remote(keys)))
        PrefixFetcher(fmt, tiers=[host, disk]).store(pages)
        host.flush(30)
        disk.flush(30)
        ks.ttft(modes["local"], prefix, f"warm-{r}")
        for name, eng in modes.items():
            prompt = prefix + ks.tokens(64, seed=400 + r)
            stream = None
            if name == "first-ask":  # a receiver that never copied from the holder, told its stream by the request
                eng.fetcher.peer_client._forget_stream("holder")
                stream = ray.get(holder.stream_location.remote())
            MARKS.clear()
            mark("start")
            elapsed, _ = ks.ttft(eng, prompt, f"{name}-{r}", peer_hint="holder", peer_stream=stream)
            MARKS.append(("ttft", MARKS[0][1] + elapsed))  # the first output in the caller's hands
            MARKS.sort(key=lambda item: item[1])
            for tier in eng.fetcher.tiers:
                tier.flush(30)
            if r:
                t0 = MARKS[0][1]
                lines[name].append([(n, (t - t0) * 1000) for n, t in MARKS])
    for name, runs in lines.items():
        print(f"\n{name}: median over {len(runs)} rounds (ms since the call)")
        names = [n for n, _ in runs[0]]
        print("  ttft median %.1f ms" % statistics.median(dict(run)["ttft"] for run in runs))
        if all([n for n, _ in run] == names for run in runs):
            print("  " + "  ".join(f"{n} {statistics.median(run[i][1] for run in runs):.1f}"
                                   for i, n in enumerate(names)))
        else:
            for run in runs:
                print("  " + "  ".join(f"{n} {t:.1f}" for n, t in run))
    ray.shutdown()
    server.close()


if __name__ == "__main__":
    main()
