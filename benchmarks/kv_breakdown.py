"""Where a 16-page KV load's time goes, path by path (BENCHMARKS.md 0f): the parts that ``benchmarks/kv_sources.py``
times as one.

1. Peer copy from a CPU holder's shared pool on this node: the export call to the holder (and an empty call: the
   round trip alone), the copy out of the holder's pool, the writes into the reader's pool. The export call goes over
   the holder's socket as the replicas' client asks after its first fetch (replica/pool_socket.py), or through the
   holder's Ray actor with ``--export-through-ray`` (as every fetch did before that socket).
   With ``--object-store``, also the path to a holder on another node (the receiver names no node, so the holder
   answers a host bundle through Ray's object store, as across nodes): an empty call, the export call (the holder's
   copy out of its pool, Ray storing the bundle, the receiver mapping it), the writes into the reader's pool, and
   the holder's copy and a ``ray.put`` of the same bundle timed inside the holder; then the same pages over the
   holder's TCP page stream (replica/page_stream.py: sent straight out of its pool, received into an array per page), as the
   replicas' client asks once a host bundle has named it.
2. Redis (TCP and unix socket) and disk tier loads of pages stored just before (fresh: each round stores new pages,
   as a real load finds them) split into the tier's ``load`` and the writes into the reader's pool.
3. A raw ``MGET`` of the same number of values of the same size read off a unix socket with ``recv_into`` into one
   buffer, against redis-py's own parser: what ``redis-server`` writing the reply costs without any decryption.

The tier pages hold random KV under real keys and token ids (what a load verifies); timing does not depend on it.

    PYTHONPATH=. .venv/bin/python benchmarks/kv_breakdown.py [--dtype bfloat16] [--rounds 30] [--peer-only]
        [--export-through-ray] [--object-store]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import time

import ray
import redis
import torch

from benchmarks.kv_sources import (Holder, engine_config, ensure_model, page_template, peer_client, private_redis,
                                   random_pages, tokens)
from replica.engine import build_engine
from replica.kv_sources import PrefixFetcher, build_tiers, page_format_of
from replica.peer_copy import PeerExportRequest, unbundle_pages
from replica.shared_pool import node_id

PAGE_SIZE = 128


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.2f} ms (min {min(values) * 1e3:.2f})"


def peer_rows(args, reader, keys, nbytes: int) -> list[str]:
    holder = Holder.remote(engine_config(args, "holder"))
    ray.get(holder.compute.remote(args.prefix))
    client = peer_client(holder, shared_memory=True)
    loop = asyncio.new_event_loop()
    parts = {"export call": [], "copy out of the holder's pool": [], "writes into the reader's pool": [],
             "whole fetch": [], "an empty export call (round trip alone)": []}
    request = PeerExportRequest("holder", list(keys), None, node_id())
    socket_export = getattr(client, "_ask_socket", None)  # a checkout before the holder's export socket has none
    if socket_export is not None:
        loop.run_until_complete(client.fetch("holder", list(keys)))  # the first fetch (through Ray) learns the socket
    for round_ in range(args.rounds + 3):
        t0 = time.perf_counter()
        bundle = None
        if socket_export is not None and not args.export_through_ray:
            bundle = loop.run_until_complete(socket_export("holder", list(keys)))
        if bundle is None:
            bundle = loop.run_until_complete(client._export(request))
        t1 = time.perf_counter()
        pages = loop.run_until_complete(loop.run_in_executor(client.pool_reader.executor,
                                                             client.pool_reader.copy_pages, bundle))
        t2 = time.perf_counter()
        for page_id, page in enumerate(pages):
            reader.runner.write_page(page_id, page.kv)
        t3 = time.perf_counter()
        if socket_export is not None and not args.export_through_ray:
            assert loop.run_until_complete(socket_export("holder", [])) is not None
        else:
            loop.run_until_complete(client._export(PeerExportRequest("holder", [], None, node_id())))
        t4 = time.perf_counter()
        assert len(pages) == len(keys)
        del pages
        if round_ >= 3:  # the first rounds map the holder's pool in
            for name, value in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0, t4 - t3)):
                parts[name].append(value)
    loop.close()
    whole = statistics.median(parts["whole fetch"])
    path = "peer, shared pool, export " + ("through Ray" if socket_export is None or args.export_through_ray
                                           else "over the holder's socket")
    return [f"| {path} | {name} | {ms(values)} |" for name, values in parts.items()] + [
        f"| {path} | effective | {nbytes / whole / 1e9:.2f} GB/s |"]


def object_store_rows(args, reader, keys, nbytes: int) -> list[str]:
    holder = Holder.remote(engine_config(args, "far-holder"))
    ray.get(holder.compute.remote(args.prefix))
    client = peer_client(holder, shared_memory=False)  # names no node: a host bundle, as from another node
    loop = asyncio.new_event_loop()
    parts = {"an empty export call (round trip alone)": [], "export call (holder copy, object store, receiver get)": [],
             "writes into the reader's pool": [], "whole fetch": []}
    for round_ in range(args.rounds + 3):
        t0 = time.perf_counter()
        loop.run_until_complete(client._export(PeerExportRequest("holder", [])))
        t1 = time.perf_counter()
        bundle = loop.run_until_complete(client._export(PeerExportRequest("holder", list(keys))))
        t2 = time.perf_counter()
        pages = unbundle_pages(bundle)
        for page_id, page in enumerate(pages):
            reader.runner.write_page(page_id, page.kv)
        t3 = time.perf_counter()
        assert len(pages) == len(keys)
        del pages, bundle
        if round_ >= 3:
            for name, value in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t1)):
                parts[name].append(value)
    loop.close()
    inside = ray.get(holder.time_export.remote(list(keys), args.rounds + 3))[3:]
    parts["inside the holder: its copy out of the pool"] = [copy for copy, _put in inside]
    parts["inside the holder: ray.put of that bundle"] = [put for _copy, put in inside]
    whole = statistics.median(parts["whole fetch"])
    path = "peer, object store (a holder on another node)"
    rows = [f"| {path} | {name} | {ms(values)} |" for name, values in parts.items()] + [
        f"| {path} | effective | {nbytes / whole / 1e9:.2f} GB/s |"]

    client = peer_client(holder, shared_memory=False, stream=True)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(client.fetch("holder", list(keys)))  # through Ray: names the holder's page stream
    parts = {"pages over the stream (ask, send, receive)": [], "writes into the reader's pool": [], "whole fetch": []}
    for round_ in range(args.rounds + 3):
        t0 = time.perf_counter()
        pages = loop.run_until_complete(client._ask_stream("holder", list(keys)))
        t1 = time.perf_counter()
        for page_id, page in enumerate(pages):
            reader.runner.write_page(page_id, page.kv)
        t2 = time.perf_counter()
        assert len(pages) == len(keys)
        del pages
        if round_ >= 3:
            for name, value in zip(parts, (t1 - t0, t2 - t1, t2 - t0)):
                parts[name].append(value)
    loop.close()
    client.close()
    whole = statistics.median(parts["whole fetch"])
    path = "peer, TCP page stream (a holder on another node)"
    return rows + [f"| {path} | {name} | {ms(values)} |" for name, values in parts.items()] + [
        f"| {path} | effective | {nbytes / whole / 1e9:.2f} GB/s |"]


def tier_rows(args, reader, page_format, template, redis_url, redis_unix_url, disk_dir, nbytes: int) -> list[str]:
    host, disk = build_tiers(page_format, redis_url=redis_url, disk_cache_dir=disk_dir, disk_budget_bytes=4 << 30)
    host_unix = build_tiers(page_format, redis_url=redis_unix_url, disk_cache_dir=None, disk_budget_bytes=0)[0]
    tiers = {"Redis (TCP)": host, "Redis (unix socket)": host_unix, "disk": disk}
    parts = {name: ([], []) for name in tiers}
    for round_ in range(args.rounds + 2):
        keys, slices, pages = random_pages(reader, template, tokens(args.prefix_len, seed=1000 + round_), PAGE_SIZE)
        PrefixFetcher(page_format, tiers=[host, disk]).store(pages)
        host.flush(30)
        disk.flush(30)
        del pages
        for name, tier in tiers.items():
            t0 = time.perf_counter()
            loaded = tier.load(keys, slices)
            t1 = time.perf_counter()
            for page_id, kv in enumerate(loaded):
                reader.runner.write_page(page_id, kv)
            t2 = time.perf_counter()
            assert len(loaded) == len(keys), name
            del loaded
            if round_ >= 2:
                parts[name][0].append(t1 - t0)
                parts[name][1].append(t2 - t1)
    for tier in (host, host_unix, disk):
        tier.close()
    rows = []
    for name, (loads, writes) in parts.items():
        whole = statistics.median([a + b for a, b in zip(loads, writes)])
        rows += [f"| {name} | the tier's load | {ms(loads)} |", f"| {name} | writes into the reader's pool | {ms(writes)} |",
                 f"| {name} | effective | {nbytes / whole / 1e9:.2f} GB/s ({whole * 1e3:.2f} ms) |"]
    return rows


def raw_mget_rows(args, redis_socket: str, num_values: int, value_bytes: int) -> list[str]:
    client = redis.Redis(unix_socket_path=redis_socket)
    keys = [f"kv-breakdown-{i}".encode() for i in range(num_values)]
    for key in keys:
        client.set(key, os.urandom(value_bytes))
    command = (b"*%d\r\n$4\r\nMGET\r\n" % (num_values + 1)
               + b"".join(b"$%d\r\n%s\r\n" % (len(key), key) for key in keys))
    reply_bytes = len(b"*%d\r\n" % num_values) + num_values * (len(b"$%d\r\n" % value_bytes) + value_bytes + 2)
    buffer = bytearray(reply_bytes)
    view = memoryview(buffer)
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(redis_socket)

    def raw() -> None:
        sock.sendall(command)
        got = 0
        while got < reply_bytes:
            got += sock.recv_into(view[got:], reply_bytes - got)

    results = {}
    for name, call in (("redis-py's parser", lambda: client.mget(keys)), ("recv_into one buffer", raw)):
        values = []
        for round_ in range(args.rounds + 3):
            t0 = time.perf_counter()
            call()
            if round_ >= 3:
                values.append(time.perf_counter() - t0)
        results[name] = values
    sock.close()
    client.delete(*keys)
    client.close()
    return [f"| raw MGET, unix socket, no decryption | {name} | {ms(values)} |" for name, values in results.items()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--peer-only", action="store_true", help="only the peer rows")
    parser.add_argument("--export-through-ray", action="store_true",
                        help="ask the holder through its Ray actor every time, not over its export socket")
    parser.add_argument("--object-store", action="store_true",
                        help="also the rows of a holder on another node (a host bundle through the object store)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ensure_model()
    args.prefix = tokens(args.prefix_len, seed=0)
    server = private_redis("2gb")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        time.sleep(0.5)
        reader = build_engine(engine_config(args, "reader"))
        page_format = page_format_of(reader)
        template = page_template(reader, args.prefix, PAGE_SIZE)
        keys = reader.page_keys(args.prefix)
        nbytes = len(keys) * page_format.page_num_bytes
        rows = peer_rows(args, reader, keys, nbytes)
        if args.object_store:
            rows += object_store_rows(args, reader, keys, nbytes)
        if not args.peer_only:
            rows += tier_rows(args, reader, page_format, template, f"redis://127.0.0.1:{server.port}/0",
                              f"unix://{server.socket}?db=0", server.folder, nbytes)
            rows += raw_mget_rows(args, server.socket, len(keys), page_format.page_num_bytes)
        print(f"\n{len(keys)} pages of {page_format.page_num_bytes / 2**20:.2f} MiB = {nbytes / 2**20:.1f} MiB, "
              f"{args.dtype}; medians of {args.rounds} rounds")
        print("\n| path | part | time |\n|---|---|---|")
        print("\n".join(rows))
    finally:
        ray.shutdown()
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
