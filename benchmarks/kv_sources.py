"""Time to obtain the KV pages of a shared prefix from each source, side by side in one run:
recompute (prefill), peer copy (another process, through Ray's object store), Redis host tier, Arrow disk tier.
Then TTFT of a request whose prefix lives on the other replica with peer copy on, with copy off (shared tier only),
and with no shared tier at all (recompute).

Usage (needs a redis-server binary; the script starts its own on a free port):
    python benchmarks/kv_sources.py [--prefix-len 2048] [--rounds 5] [--dtype bfloat16] [--tiers-only]

--tiers-only times only the Redis and disk rows (no Ray, no peer, no TTFT table). The tiers are built through
``build_tiers`` with whatever page codec the checked-out code has, so running this same file with PYTHONPATH pointing
at two checkouts compares them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import ray
import torch

from replica.async_engine import AsyncEngine
from replica.config import EngineConfig
from replica.engine import build_engine
from replica.kv_sources import PrefixFetcher, build_tiers, page_format_of
from common.types import EngineRequest
from replica.peer_copy import bundle_pages, unbundle_pages
from common.types import SamplingParams

from bench.tiny_models import write_tiny_model

MODEL_DIR = Path(tempfile.gettempdir()) / "prefixserve-bench-llama-512x8"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 8000, (n,), generator=g).tolist()


def engine_config(args, replica_id: str) -> EngineConfig:
    return EngineConfig(model=str(MODEL_DIR), dtype=args.dtype, kv_cache_memory_bytes=1 << 30,
                        max_num_batched_tokens=4096, max_model_len=4096, replica_id=replica_id)


@ray.remote(num_cpus=0)
class Holder:
    """Another replica process: computes prefixes and exports their pages."""

    def __init__(self, config: EngineConfig) -> None:
        torch.set_num_threads(1)
        self.engine = build_engine(config)

    def compute(self, prompt: list[int]) -> int:
        self.engine.add_request(EngineRequest("p", prompt, SamplingParams(max_tokens=1, temperature=0.0)))
        while self.engine.has_work():
            self.engine.step()
        return len(self.engine.page_keys(prompt))

    def export(self, keys):
        return bundle_pages(self.engine.export_pages(list(keys)))


class RayPeerClient:
    def __init__(self, holder) -> None:
        self.holder = holder

    async def fetch(self, peer_id, keys):
        return unbundle_pages(await self.holder.export.remote(list(keys)))


def ttft(async_engine: AsyncEngine, prompt, request_id, peer_hint=None) -> tuple[float, dict]:
    async def run():
        start = time.perf_counter()
        request = EngineRequest(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0), peer_hint=peer_hint)
        async for out in async_engine.generate(request):
            return time.perf_counter() - start, out.cached_tokens.as_dict()

    return asyncio.run(run())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiers-only", action="store_true", help="only the Redis and disk rows (no Ray)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if not (MODEL_DIR / "config.json").exists():
        write_tiny_model(MODEL_DIR, arch="llama", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                         vocab_size=8192, seed=0)
    port = free_port()
    redis_proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--save", "", "--appendonly",
                                   "no", "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"],
                                  stdout=subprocess.DEVNULL)
    disk_dir = tempfile.mkdtemp(prefix="prefixserve-bench-disk-")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not args.tiers_only:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        time.sleep(0.5)
        redis_url = f"redis://127.0.0.1:{port}/0"
        holder = None if args.tiers_only else Holder.remote(engine_config(args, "holder"))
        reader = build_engine(engine_config(args, "reader"))
        page_format = page_format_of(reader)
        host, disk = build_tiers(page_format, redis_url=redis_url, disk_cache_dir=disk_dir, disk_budget_bytes=4 << 30)
        results = {"recompute": [], "peer": [], "host": [], "disk": []}
        if args.tiers_only:
            del results["peer"]
        for r in range(args.rounds):
            prefix = tokens(args.prefix_len, seed=r)
            keys = reader.page_keys(prefix)
            slices = [prefix[i * 128:(i + 1) * 128] for i in range(len(keys))]
            # recompute: prefill the prefix on the reader
            start = time.perf_counter()
            reader.add_request(EngineRequest(f"r{r}", prefix, SamplingParams(max_tokens=1, temperature=0.0)))
            while reader.has_work():
                reader.step()
            results["recompute"].append(time.perf_counter() - start)
            pages = reader.export_pages(keys)
            PrefixFetcher(page_format, tiers=[host, disk]).store(pages)
            host.flush(30)
            disk.flush(30)
            page_id = 0
            if not args.tiers_only:
                ray.get(holder.compute.remote(prefix))
                # peer: export on the holder process, object store, unbundle, write into the reader's pool
                start = time.perf_counter()
                got = unbundle_pages(ray.get(holder.export.remote(keys)))
                for page in got:
                    reader.runner.write_page(page_id, page.kv)
                results["peer"].append(time.perf_counter() - start)
                assert len(got) == len(keys)
            for name, tier in (("host", host), ("disk", disk)):
                start = time.perf_counter()
                loaded = tier.load(keys, slices)
                for kv in loaded:
                    reader.runner.write_page(page_id, kv)
                results[name].append(time.perf_counter() - start)
                assert len(loaded) == len(keys), name

        med = statistics.median
        base = med(results["recompute"])
        print(f"\n| source ({args.prefix_len}-token prefix, {len(keys)} pages, {args.dtype}) | median | min | "
              f"speed-up vs recompute |")
        print("|---|---|---|---|")
        num_bytes = len(keys) * page_format.page_num_bytes
        print(f"\n{len(keys)} pages = {num_bytes / 2**20:.1f} MiB; effective GB/s = bytes / median time "
              "(fetch + verify + decode + write into the pool)")
        for name, values in results.items():
            print(f"| {name} | {med(values) * 1000:.1f} ms | {min(values) * 1000:.1f} ms | {base / med(values):.1f}x |"
                  f" {num_bytes / med(values) / 1e9:.2f} GB/s |")
        if args.tiers_only:
            host.close()
            disk.close()
            return 0

        # TTFT of a request whose prefix lives on the other replica
        def make(peer: bool, tiers: bool, rid: str) -> AsyncEngine:
            engine = build_engine(engine_config(args, rid))
            fmt = page_format_of(engine)
            fetcher = PrefixFetcher(fmt, tiers=build_tiers(fmt, redis_url=redis_url, disk_cache_dir=None,
                                                            disk_budget_bytes=0) if tiers else [],
                                    peer_client=RayPeerClient(holder) if peer else None, own_replica_id=rid)
            return AsyncEngine(engine, fetcher)

        modes = {"copy on (peer)": make(True, True, "m1"), "copy off (Redis tier)": make(False, True, "m2"),
                 "no shared tier (recompute)": make(False, False, "m3")}
        ttfts = {name: [] for name in modes}
        sources = {}
        for r in range(args.rounds):
            prefix = tokens(args.prefix_len, seed=100 + r)
            ray.get(holder.compute.remote(prefix))
            keys = reader.page_keys(prefix)
            writer_pages = unbundle_pages(ray.get(holder.export.remote(keys)))
            PrefixFetcher(page_format, tiers=[host]).store(writer_pages)
            host.flush(30)
            for name, eng in modes.items():
                prompt = prefix + tokens(args.suffix_len, seed=200 + r)
                elapsed, cached = ttft(eng, prompt, f"{name}-{r}", peer_hint="holder")
                ttfts[name].append(elapsed)
                sources[name] = cached
        print(f"\n| TTFT, prefix held by the other replica ({args.prefix_len}+{args.suffix_len} tokens) | median | "
              f"cached tokens by source |")
        print("|---|---|---|")
        for name, values in ttfts.items():
            print(f"| {name} | {med(values) * 1000:.1f} ms | {sources[name]} |")
        for eng in modes.values():
            eng.shutdown()
        host.close()
        disk.close()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        redis_proc.terminate()
        shutil.rmtree(disk_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
