"""Time to obtain the KV pages of a shared prefix from each source, side by side in one run:
recompute (prefill), peer copy (another process on this node: straight from its shared pool, and as between nodes
through Ray's object store or over the holder's TCP page stream), Redis host tier, Arrow disk tier.
Each fetch includes the write into the reader's page pool (page i of the prefix into pool page i; "into pool pages":
the tier decrypts straight into those pages, as the engine does since session 36, replica/landing.py); wall time and
the reading thread's CPU time are reported
(the peer rows' CPU excludes the holder process, Ray's threads and the shared-pool copy's worker thread).
Then TTFT of a request (prefix + new suffix) whose prefix is: in the replica's own cache (local hit, the reference),
on the other replica (peer copy on), only in Redis, only on disk, or nowhere (recompute); with the ratio to the local
hit. Background tier writes are flushed between measurements so one row does not slow the next. TTFT ends when the
request's first output reaches its caller: work the request starts after that (since session 43, the tier writes of
pages copied from a peer) is not in it; under Serve the caller has handed the token on to Ray by then, but that work
then shares the cores with the token's way to the ingress.

Usage (needs a redis-server binary; the script starts its own on a free port):
    python benchmarks/kv_sources.py [--prefix-len 2048] [--rounds 5] [--dtype bfloat16] [--tiers-only]
        [--model-dir DIR [--kv-cache-mib 512]]

--model-dir serves another model folder than the tiny Llama (e.g. the Qwen2-0.5B-shaped one that
``MODEL_SHAPE=qwen2-0.5b benchmarks/vs_vllm.sh model`` writes), whose pages are larger; --kv-cache-mib sizes each
replica's pool (256 MiB: 256 of the tiny Llama's 1 MiB bfloat16 pages).

--tiers-only times only the Redis and disk rows (no Ray, no peer, no TTFT table). The tiers are built through
``build_tiers`` with whatever page codec the checked-out code has, so running this same file with PYTHONPATH pointing
at two checkouts compares them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from replica.async_engine import AsyncEngine
from replica.config import EngineConfig
from replica.engine import build_engine
from replica.kv_sources import PrefixFetcher, build_tiers, page_format_of
from replica.landing import LandingPages
from common.types import EngineRequest
from replica.page_record import PageRecord
from replica.peer_copy import PeerExportRequest, ServePeerClient, bundle_pages, unbundle_pages
from common.types import SamplingParams

from bench.tiny_models import write_tiny_model

MODEL_DIR = Path(tempfile.gettempdir()) / "prefixserve-bench-llama-512x8"


def export_pages(engine, keys):
    """What a replica's ``export_pages`` answers a peer (one contiguous tensor where this checkout supports it)."""
    try:
        return engine.export_pages(keys, contiguous=True)
    except TypeError:  # a checkout before contiguous exports
        return engine.export_pages(keys)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_model() -> None:
    """The tiny Llama (hidden 512 x 8 layers) at ``MODEL_DIR``, written once."""
    if not (MODEL_DIR / "config.json").exists():
        write_tiny_model(MODEL_DIR, arch="llama", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                         vocab_size=8192, seed=0)


@dataclass
class PrivateRedis:
    """A redis-server of this run's own (``private_redis``); ``close`` stops it and removes its folder."""

    port: int
    folder: str
    """A temporary folder that holds the socket and serves as the disk tier's root."""
    socket: str
    process: subprocess.Popen

    def close(self) -> None:
        self.process.terminate()
        shutil.rmtree(self.folder, ignore_errors=True)


def private_redis(maxmemory: str) -> PrivateRedis:
    """A redis-server of this run's own on a free port and a unix socket (no persistence)."""
    port = free_port()
    folder = tempfile.mkdtemp(prefix="prefixserve-bench-disk-")
    redis_socket = os.path.join(folder, "redis.sock")
    process = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--unixsocket", redis_socket,
                                "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--maxmemory", maxmemory,
                                "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL)
    return PrivateRedis(port, folder, redis_socket, process)


FIRST_ASK = "peer copy, first ask from another node: the stream the router named (copy on, Redis behind it)"
"""A receiver that never copied from the holder: the request carries the holder's page stream (its routing stats),
so the first copy skips the object store."""


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 8000, (n,), generator=g).tolist()


def page_template(reader, prefix: list[int], page_size: int = 128) -> PageRecord:
    """One page of ``reader``'s format (its first page of ``prefix``, computed): what random test pages copy."""
    head = prefix[:page_size]
    reader.add_request(EngineRequest("template", head, SamplingParams(max_tokens=1, temperature=0.0)))
    while reader.has_work():
        reader.step()
    return reader.export_pages(reader.page_keys(head))[0]


def random_pages(reader, template: PageRecord, prefix: list[int], page_size: int = 128):
    """(keys, token ids per page, pages) of ``prefix``'s full pages under their real keys and token ids, holding random
    KV (what a tier load verifies; timing does not depend on the values)."""
    keys = reader.page_keys(prefix)
    slices = [prefix[i * page_size:(i + 1) * page_size] for i in range(len(keys))]
    pages = [dataclasses.replace(template, key=key, token_ids=tuple(token_ids),
                                 kv=torch.randn(template.kv.shape).to(template.kv.dtype))
             for key, token_ids in zip(keys, slices)]
    return keys, slices, pages


def engine_config(args, replica_id: str) -> EngineConfig:
    return EngineConfig(model=str(args.model_dir or MODEL_DIR), dtype=args.dtype,
                        kv_cache_memory_bytes=args.kv_cache_mib << 20,
                        max_num_batched_tokens=4096, max_model_len=4096, replica_id=replica_id)


@ray.remote(num_cpus=0)
class Holder:
    """Another replica process: computes prefixes and exports their pages."""

    def __init__(self, config: EngineConfig) -> None:
        torch.set_num_threads(1)
        self.engine = build_engine(config)
        pool = getattr(self.engine.runner, "shared_pool", None)
        if hasattr(pool, "serve_exports"):  # as AsyncEngine does: peers of this node ask over a socket once they know it
            pool.serve_exports(self.engine.share_pages)
        if hasattr(pool, "serve_stream"):  # and peers of other nodes over TCP (here on the loopback address)
            pool.serve_stream(self.engine.share_pages, "127.0.0.1")
        self.stream = getattr(pool, "stream_location", None)

    def stream_location(self):
        """Its page stream, as its routing stats name it to the routers (None without one)."""
        return self.stream

    def compute(self, prompt: list[int]) -> int:
        self.engine.add_request(EngineRequest("p", prompt, SamplingParams(max_tokens=1, temperature=0.0)))
        while self.engine.has_work():
            self.engine.step()
        return len(self.engine.page_keys(prompt))

    def export(self, keys):
        """A host bundle naming this holder's page stream, as ``ServeReplica.export_pages`` answers another node."""
        bundle = bundle_pages(export_pages(self.engine, list(keys)))
        return dataclasses.replace(bundle, stream=self.stream) if self.stream is not None else bundle

    def time_export(self, keys, rounds: int) -> list[tuple[float, float]]:
        """(the export's copy out of the pool, ``ray.put`` of the bundle) in seconds, ``rounds`` times: the holder's
        share of a host bundle's trip through the object store (kv_breakdown.py)."""
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            bundle = self.export(keys)
            copied = time.perf_counter()
            ref = ray.put(bundle)
            times.append((copied - start, time.perf_counter() - copied))
            del ref, bundle
        return times

    def export_pages(self, request: PeerExportRequest):
        """What a replica answers a peer: where the pages lie in its shared pool when the peer is on this node and
        names it, else a host bundle (``ServeReplica.export_pages`` on the CPU)."""
        share = getattr(self.engine, "share_pages", None)  # a checkout before shared pools has none
        if getattr(request, "node_id", None) is not None and share is not None:
            from replica.shared_pool import node_id

            if request.node_id == node_id():
                shared = share(list(request.keys))
                if shared is not None:
                    return shared
        return self.export(request.keys)


def peer_client(holder, *, shared_memory: bool, stream: bool = False) -> ServePeerClient:
    """The replicas' own peer client over the holder actor (``shared_memory=False``: it asks as a peer on another
    node does, for a host bundle through the object store; with ``stream``, over the holder's page stream once a
    host bundle has named it, as the replicas' client does by default)."""
    client = ServePeerClient("bench", "bench", timeout_s=60, handle=holder)
    if not shared_memory:
        client.node_id = None
    client.use_streams = stream
    return client


def ttft(async_engine: AsyncEngine, prompt, request_id, peer_hint=None, peer_stream=None) -> tuple[float, dict]:
    async def run():
        start = time.perf_counter()
        named = {"peer_stream": peer_stream} if peer_stream is not None else {}  # a checkout before it has none
        request = EngineRequest(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0), peer_hint=peer_hint,
                                **named)
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
    parser.add_argument("--model-dir", default=None, help="a model folder (default: the tiny Llama, written once)")
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="each replica's KV pool")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.model_dir is None:
        ensure_model()
    server = private_redis("1gb")
    disk_dir = server.folder
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not args.tiers_only:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        time.sleep(0.5)
        redis_url = f"redis://127.0.0.1:{server.port}/0"  # as from another node
        redis_unix_url = f"unix://{server.socket}?db=0"  # as on the node that runs redis-server (--start-redis)
        holder = None if args.tiers_only else Holder.remote(engine_config(args, "holder"))
        reader = build_engine(engine_config(args, "reader"))
        page_format = page_format_of(reader)
        host, disk = build_tiers(page_format, redis_url=redis_url, disk_cache_dir=disk_dir, disk_budget_bytes=4 << 30)
        host_unix = build_tiers(page_format, redis_url=redis_unix_url, disk_cache_dir=None, disk_budget_bytes=0)[0]  # the same keys, through the unix socket
        results = {"recompute": [], "peer (shared memory)": [], "peer (object store)": [],
                   "peer (TCP page stream)": [], "Redis (TCP)": [], "Redis (unix socket)": [], "disk": []}
        landing = "out" in inspect.signature(host.load).parameters  # a checkout with landing pages
        if landing:
            for name in ("Redis (TCP)", "Redis (unix socket)", "disk"):
                results[f"{name}, into pool pages"] = []
        peer_landing = "landing" in inspect.signature(ServePeerClient.fetch).parameters and not args.tiers_only
        if peer_landing:
            for name in ("peer (shared memory)", "peer (TCP page stream)"):
                results[f"{name}, into pool pages"] = []
        cpu = {name: [] for name in results}
        peers = {}
        if args.tiers_only:
            for name in ("peer (shared memory)", "peer (object store)", "peer (TCP page stream)"):
                del results[name]
                del cpu[name]
        else:
            peers = {"peer (shared memory)": peer_client(holder, shared_memory=True),
                     "peer (object store)": peer_client(holder, shared_memory=False),
                     "peer (TCP page stream)": peer_client(holder, shared_memory=False, stream=True)}
        loop = asyncio.new_event_loop()
        if peers:  # the first copy goes through Ray and names the holder's page stream (not counted)
            warm_up = tokens(args.prefix_len, seed=999)
            ray.get(holder.compute.remote(warm_up))
            for client in peers.values():
                loop.run_until_complete(client.fetch("holder", reader.page_keys(warm_up)))
        for r in range(args.rounds):
            prefix = tokens(args.prefix_len, seed=r)
            keys = reader.page_keys(prefix)
            slices = [prefix[i * 128:(i + 1) * 128] for i in range(len(keys))]
            # recompute: prefill the prefix on the reader
            start, cpu_start = time.perf_counter(), time.thread_time()
            reader.add_request(EngineRequest(f"r{r}", prefix, SamplingParams(max_tokens=1, temperature=0.0)))
            while reader.has_work():
                reader.step()
            results["recompute"].append(time.perf_counter() - start)
            cpu["recompute"].append(time.thread_time() - cpu_start)
            pages = reader.export_pages(keys)
            PrefixFetcher(page_format, tiers=[host, disk]).store(pages)
            host.flush(30)
            disk.flush(30)
            if not args.tiers_only:
                ray.get(holder.compute.remote(prefix))
            for name, client in peers.items():
                # peer: the replicas' client asks the holder process, copies (shared pool) or receives (object
                # store) the pages, then they are written into the reader's pool
                start, cpu_start = time.perf_counter(), time.thread_time()
                got = loop.run_until_complete(client.fetch("holder", keys))
                for page_id, page in enumerate(got):
                    reader.runner.write_page(page_id, page.kv)
                results[name].append(time.perf_counter() - start)
                cpu[name].append(time.thread_time() - cpu_start)
                assert len(got) == len(keys), name
                del got
            for name in ("peer (shared memory)", "peer (TCP page stream)") if peer_landing else ():
                # since session 37 the engine's path: copied / received straight into the pages (landing.py)
                views = [reader.runner.read_page(page_id) for page_id in range(len(keys))]
                start, cpu_start = time.perf_counter(), time.thread_time()
                got = loop.run_until_complete(peers[name].fetch(
                    "holder", keys, LandingPages(list(range(len(keys))), views, lambda _: None)))
                results[f"{name}, into pool pages"].append(time.perf_counter() - start)
                cpu[f"{name}, into pool pages"].append(time.thread_time() - cpu_start)
                assert len(got) == len(keys) and all(page.landing_page is not None for page in got), name
                del got
            for name, tier in (("Redis (TCP)", host), ("Redis (unix socket)", host_unix), ("disk", disk)):
                start, cpu_start = time.perf_counter(), time.thread_time()
                loaded = tier.load(keys, slices)
                for page_id, kv in enumerate(loaded):
                    reader.runner.write_page(page_id, kv)
                results[name].append(time.perf_counter() - start)
                cpu[name].append(time.thread_time() - cpu_start)
                assert len(loaded) == len(keys), name
                if landing:  # the engine's path since session 36: decrypted straight into the pages (landing.py)
                    start, cpu_start = time.perf_counter(), time.thread_time()
                    loaded = tier.load(keys, slices, [reader.runner.read_page(page_id) for page_id in range(len(keys))])
                    results[f"{name}, into pool pages"].append(time.perf_counter() - start)
                    cpu[f"{name}, into pool pages"].append(time.thread_time() - cpu_start)
                    assert len(loaded) == len(keys), name

        med = statistics.median
        base = med(results["recompute"])
        num_bytes = len(keys) * page_format.page_num_bytes
        print(f"\n{len(keys)} pages = {num_bytes / 2**20:.1f} MiB; effective GB/s = bytes / median wall time "
              "(fetch + verify + decrypt + write into the pool); CPU = the calling thread's time.thread_time "
              "(work on the sources' own threads is not in it: a peer copy, a disk load, half of a Redis load)")
        print(f"\n| source ({args.prefix_len}-token prefix, {len(keys)} pages, {args.dtype}) | median | min | "
              "speed-up vs recompute | effective GB/s | reader thread CPU median | GB/s per CPU-second |")
        print("|---|---|---|---|---|---|---|")
        for name, values in results.items():
            print(f"| {name} | {med(values) * 1000:.1f} ms | {min(values) * 1000:.1f} ms | {base / med(values):.1f}x |"
                  f" {num_bytes / med(values) / 1e9:.2f} | {med(cpu[name]) * 1000:.1f} ms |"
                  f" {num_bytes / med(cpu[name]) / 1e9:.2f} |")
        host_unix.close()
        if args.tiers_only:
            host.close()
            disk.close()
            return 0

        # TTFT of a request whose prefix is local, on the other replica, in one shared tier, or nowhere
        def make(rid: str, *, peer: str | None = None, redis: str | None = None, disk: bool = False) -> AsyncEngine:
            engine = build_engine(engine_config(args, rid))
            fmt = page_format_of(engine)
            tiers = build_tiers(fmt, redis_url=redis, disk_cache_dir=disk_dir if disk else None,
                                disk_budget_bytes=4 << 30) if (redis or disk) else []
            client = peer_client(holder, shared_memory=peer == "shared", stream=peer == "stream") if peer else None
            fetcher = PrefixFetcher(fmt, tiers=tiers, peer_client=client, own_replica_id=rid)
            return AsyncEngine(engine, fetcher)

        modes = {"local hit (reference)": make("m0"),
                 "peer copy, shared pool (copy on, Redis behind it)": make("m1", peer="shared", redis=redis_url),
                 "peer copy, object store (copy on, Redis behind it)": make("m5", peer="store", redis=redis_url),
                 "peer copy, TCP page stream (copy on, Redis behind it)": make("m7", peer="stream", redis=redis_url),
                 FIRST_ASK: make("m8", peer="stream", redis=redis_url),
                 "Redis tier over TCP (copy off)": make("m2", redis=redis_url),
                 "Redis tier over a unix socket (copy off)": make("m6", redis=redis_unix_url),
                 "disk tier": make("m3", disk=True),
                 "recompute (no shared tier)": make("m4")}
        if not hasattr(ServePeerClient, "learn_stream"):  # a checkout before the router named holders' streams
            modes.pop(FIRST_ASK).shutdown()
        holder_stream = ray.get(holder.stream_location.remote())
        ttfts = {name: [] for name in modes}
        sources = {}

        def settle(eng: AsyncEngine) -> None:
            for tier in eng.fetcher.tiers:
                tier.flush(30)

        for r in range(args.rounds + 1):  # round 0 warms every engine up and is not counted
            prefix = tokens(args.prefix_len, seed=100 + r)
            ray.get(holder.compute.remote(prefix))
            keys = reader.page_keys(prefix)
            writer_pages = unbundle_pages(ray.get(holder.export.remote(keys)))
            PrefixFetcher(page_format, tiers=[host, disk]).store(writer_pages)
            host.flush(30)
            disk.flush(30)
            ttft(modes["local hit (reference)"], prefix, f"warm-{r}")  # the prefix into the local replica's cache
            for name, eng in modes.items():
                prompt = prefix + tokens(args.suffix_len, seed=200 + r)
                stream = None
                if name == FIRST_ASK:  # as a receiver that never copied from this holder: the request names its stream
                    eng.fetcher.peer_client._forget_stream("holder")
                    stream = holder_stream
                elapsed, cached = ttft(eng, prompt, f"{name}-{r}", peer_hint="holder", peer_stream=stream)
                settle(eng)
                if r:
                    ttfts[name].append(elapsed)
                    sources[name] = cached
        reference = med(ttfts["local hit (reference)"])
        print(f"\n| TTFT ({args.prefix_len}+{args.suffix_len} tokens, {args.dtype}), prefix from | median | min | "
              "ratio to the local hit (median) | cached tokens by source |")
        print("|---|---|---|---|---|")
        for name, values in ttfts.items():
            print(f"| {name} | {med(values) * 1000:.1f} ms | {min(values) * 1000:.1f} ms | "
                  f"{med(values) / reference:.2f}x | {sources[name]} |")
        for eng in modes.values():
            eng.shutdown()
        host.close()
        disk.close()
        loop.close()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
