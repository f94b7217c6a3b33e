"""How much the shared tiers write, on one load, with the two write policies side by side (issue: data at rest / disk
tier grew ~1.6 GB/min because every request's unique pages were written).

Load (the same for both policies, same seed): ``--num-prefixes`` shared prefixes (system prompts / documents) of
``--prefix-pages`` pages, ``--requests-per-prefix`` requests on each with a unique suffix of ``--suffix-len`` tokens,
``--max-tokens`` output tokens, interleaved, through one in-process engine (a real tiny Llama, AsyncEngine +
PrefixFetcher + DiskTier on a fresh folder). Then a second engine on the same folder (a replica that never saw the
load) replays one request per prefix: how many of its prompt tokens the tier gives it shows the tier still holds what
is worth sharing.

    PYTHONPATH=. python benchmarks/tier_writes.py [--num-prefixes 8] [--requests-per-prefix 6]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from common.types import EngineRequest, SamplingParams
from replica.async_engine import AsyncEngine
from replica.config import EngineConfig
from replica.engine import build_engine
from replica.kv_sources import PrefixFetcher, build_tiers, page_format_of
from replica.tiers.seal import TierKey

from bench.tiny_models import write_tiny_model

MODEL_DIR = Path(tempfile.gettempdir()) / "prefixserve-bench-llama-128x2"
PAGE_SIZE = 128


def tokens(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 1000, (n,), generator=generator).tolist()


def make_engine(disk_dir: str, tier_key: TierKey, policy: str, replica_id: str) -> AsyncEngine:
    engine = build_engine(EngineConfig(model=str(MODEL_DIR), dtype="float32", enforce_eager=True, num_pages=512,
                                       max_num_batched_tokens=4096, replica_id=replica_id))
    page_format = page_format_of(engine)
    tiers = build_tiers(page_format, redis_url=None, disk_cache_dir=disk_dir, disk_budget_bytes=8 << 30,
                        tier_key=tier_key)
    return AsyncEngine(engine, PrefixFetcher(page_format, tiers=tiers, own_replica_id=replica_id,
                                             write_policy=policy))


async def ask(engine: AsyncEngine, prompt: list[int], request_id: str, max_tokens: int):
    last = None
    request = EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               ignore_eos=True))
    async for out in engine.generate(request):
        last = out
    return last


def bytes_written_by_this_process() -> int:
    """``wchar`` of /proc/self/io: bytes this process passed to write() calls (page files, temp files, the index)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar"))


def disk_usage(root: str) -> tuple[int, int]:
    num_files = num_bytes = 0
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".arrow"):
                num_files += 1
                num_bytes += os.path.getsize(os.path.join(folder, name))
    return num_files, num_bytes


def run(policy: str, args, prompts) -> dict:
    disk_dir = tempfile.mkdtemp(prefix=f"prefixserve-tier-writes-{policy}-")
    tier_key = TierKey.generate()
    engine = make_engine(disk_dir, tier_key, policy, "writer")
    try:
        async def load():
            # a few requests at a time, as a server under load would run them
            for start in range(0, len(prompts), args.concurrency):
                batch = prompts[start : start + args.concurrency]
                await asyncio.gather(*(ask(engine, prompt, f"{policy}-{start + i}", args.max_tokens)
                                       for i, prompt in enumerate(batch)))

        started = time.perf_counter()
        written_before = bytes_written_by_this_process()
        asyncio.run(load())
        elapsed = time.perf_counter() - started
        for tier in engine.fetcher.tiers:
            tier.flush(60)
        written = bytes_written_by_this_process() - written_before
        stats = engine.fetcher.tiers[0].stats()
    finally:
        engine.shutdown()
    num_files, num_bytes = disk_usage(disk_dir)
    reader = make_engine(disk_dir, tier_key, policy, "reader")
    try:
        replay = prompts[: args.num_prefixes]  # the first round holds each prefix once
        outs = [asyncio.run(ask(reader, prompt[: args.prefix_pages * PAGE_SIZE] + tokens(args.suffix_len, 9999 + i),
                                f"replay-{i}", 1)) for i, prompt in enumerate(replay)]  # a new question on each prefix
        disk_tokens = sum(out.cached_tokens.disk for out in outs)
        shared_tokens = args.num_prefixes * args.prefix_pages * PAGE_SIZE
    finally:
        reader.shutdown()
        shutil.rmtree(disk_dir, ignore_errors=True)
    return dict(policy=policy, pages=stats.pages_stored, bytes=written, files=num_files,
                file_bytes=num_bytes, seconds=elapsed, disk_tokens=disk_tokens, shared_tokens=shared_tokens)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-pages", type=int, default=4)
    parser.add_argument("--requests-per-prefix", type=int, default=6)
    parser.add_argument("--suffix-len", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if not (MODEL_DIR / "config.json").exists():
        write_tiny_model(MODEL_DIR, arch="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         vocab_size=1024, seed=0)
    prefixes = [tokens(args.prefix_pages * PAGE_SIZE, seed=p) for p in range(args.num_prefixes)]
    prompts = []
    for r in range(args.requests_per_prefix):  # interleaved: prefix 0, 1, ..., then again
        for p, prefix in enumerate(prefixes):
            prompts.append(prefix + tokens(args.suffix_len, seed=1000 + p * 100 + r))
    results = [run(policy, args, prompts) for policy in ("all", "reused")]

    print(f"\nload: {len(prompts)} requests = {args.num_prefixes} prefixes x {args.requests_per_prefix}, prefix "
          f"{args.prefix_pages * PAGE_SIZE} + unique suffix {args.suffix_len} tokens, {args.max_tokens} output tokens, "
          f"{args.concurrency} at a time\n")
    print("| write policy | pages stored (incl. already there) | MiB written (write() calls) | page files after | "
          "MiB on disk | replay: prompt tokens from disk / shared-prefix tokens | load time |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['policy']} | {r['pages']} | {r['bytes'] / 2**20:.1f} | {r['files']} | "
              f"{r['file_bytes'] / 2**20:.1f} | {r['disk_tokens']} / {r['shared_tokens']} | {r['seconds']:.1f} s |")
    before, after = results
    print(f"\nwrite volume after / before: {after['bytes'] / max(1, before['bytes']):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
