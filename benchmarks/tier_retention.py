"""Retention in the Redis host tier: does a pinned prefix stay in Redis under a flood of unique pages, and what do the
retention-aware writes (SET NX EX + a small Lua script per page) cost the writer and the server?

1. Hit rate (needs a checkout with ``update_retention``): two private redis-servers (``volatile-lru``, ``--maxmemory``
   about 64 pages), one tier each, the same pages. A prefix of ``--prefix-pages`` pages is stored in both; in
   ``retention`` mode it carries priority 80 and a 600 s TTL, in ``lru`` mode none. Then, round by round and for both
   servers in turn, ``--flood-pages`` unique pages are written and the tier is asked for the prefix (``lookup``):
   a round is a hit when every prefix page is still there.
2. Write cost: ``--write-pages`` unique plain pages written through the tier (flushed), wall time, the writer's
   CPU is not separable here, so redis-server's CPU seconds (/proc) per page. Run it from two checkouts to compare
   (the old tier on ``allkeys-lru``, where its plain SETs belong):

    (cd /path/to/checkout && python /path/to/benchmarks/tier_retention.py --json out.json)

Needs redis-server (started here on free ports).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.getcwd())  # the checkout to measure

import torch  # noqa: E402

from common.page_format import PageFormat  # noqa: E402
from common.page_keys import compute_page_keys  # noqa: E402
from replica.tiers.base import StoredPage  # noqa: E402
from replica.tiers.redis_tier import RedisTier  # noqa: E402

FORMAT = PageFormat(model_fingerprint="m", dtype="bfloat16", page_size=128, num_layers=8, num_kv_heads=4, head_dim=64)
"""1 MiB of KV per page (a small model's page of 128 tokens)."""


def make_pages(num_pages: int, seed: int, **retention) -> list[StoredPage]:
    tokens = [(seed * 7919 + i * 31) % 50_000 for i in range(num_pages * 128)]
    keys = compute_page_keys(tokens, page_size=128, model_fingerprint="m", salt=str(seed))
    kv = torch.randn(FORMAT.kv_shape).to(torch.bfloat16)  # the same KV for every page: only the keys differ
    return [StoredPage.from_format(FORMAT, key, tokens[i * 128:(i + 1) * 128], kv, **retention)
            for i, key in enumerate(keys)]


def start_redis(policy: str, maxmemory: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--maxmemory", maxmemory, "--maxmemory-policy", policy],
                               stdout=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return process, f"redis://127.0.0.1:{port}/0"


def process_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def store_all(tier, pages, batch: int = 64) -> None:
    for start in range(0, len(pages), batch):
        tier.store(pages[start:start + batch])
        tier.flush(60)


def hit_rate(args) -> dict:
    results = {}
    servers, tiers = {}, {}
    try:
        for mode in ("lru", "retention"):
            servers[mode], url = start_redis("volatile-lru", args.maxmemory)
            tiers[mode] = RedisTier(url, FORMAT, queue_size=1024)
        retention = {"retention_priority": 80, "retain_until": time.time() + 600}
        prefixes = {"lru": make_pages(args.prefix_pages, seed=1),
                    "retention": make_pages(args.prefix_pages, seed=1, **retention)}
        for mode, tier in tiers.items():
            store_all(tier, prefixes[mode])
        hits = {mode: 0 for mode in tiers}
        for round_index in range(args.rounds):
            flood = make_pages(args.flood_pages, seed=1000 + round_index)
            for mode in (("lru", "retention") if round_index % 2 == 0 else ("retention", "lru")):
                store_all(tiers[mode], flood)
                hits[mode] += tiers[mode].lookup([page.key for page in prefixes[mode]]) == args.prefix_pages
        for mode, tier in tiers.items():
            stats = tier.stats()
            results[mode] = {"prefix_hit_rate": hits[mode] / args.rounds, "rounds": args.rounds,
                             "pages_stored": stats.pages_stored, "oom_refused": getattr(stats, "oom_refused", 0)}
    finally:
        for tier in tiers.values():
            tier.close()
        for process in servers.values():
            process.terminate()
    return results


def write_cost(args) -> dict:
    policy = "volatile-lru" if hasattr(RedisTier, "update_retention") else "allkeys-lru"
    process, url = start_redis(policy, "4gb")
    tier = RedisTier(url, FORMAT, queue_size=1024)
    try:
        store_all(tier, make_pages(16, seed=5))  # warm-up
        pages = make_pages(args.write_pages, seed=6)
        server_started = process_cpu_seconds(process.pid)
        started = time.perf_counter()
        store_all(tier, pages)
        wall = time.perf_counter() - started
        server = process_cpu_seconds(process.pid) - server_started
        return {"policy": policy, "pages": args.write_pages, "wall_s": round(wall, 3),
                "pages_per_s": round(args.write_pages / wall, 1),
                "server_cpu_ms_per_page": round(server / args.write_pages * 1e3, 3),
                "pages_stored": tier.stats().pages_stored}
    finally:
        tier.close()
        process.terminate()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-pages", type=int, default=8)
    parser.add_argument("--flood-pages", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--maxmemory", default="64mb")
    parser.add_argument("--write-pages", type=int, default=512)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = {"checkout": os.getcwd()}
    if hasattr(RedisTier, "update_retention"):
        out["hit_rate"] = hit_rate(args)
    out["write_cost"] = write_cost(args)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(out, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
