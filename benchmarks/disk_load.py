"""The disk tier's load alone: 16-page prefixes stored once, then loaded again and again (rotating over several sets
so they come from the page cache, not from the CPU's caches), without the pool write or anything around it.
``--pool``: instead, the load followed by the copy into the pool (what the engine did before session 36) against the
load decrypting straight into the pool's pages (replica/landing.py), alternated.

``--before PATH`` also times the ``DiskTier.load`` of another version of replica/tiers/disk_tier.py on the same tier
and files, alternating with this checkout's (e.g. ``git show REV:replica/tiers/disk_tier.py > /tmp/old_disk_tier.py``).

    PYTHONPATH=. .venv/bin/python benchmarks/disk_load.py [--dtype bfloat16] [--rounds 40] [--before /tmp/old_disk_tier.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.kv_sources import engine_config, ensure_model, page_template, random_pages, tokens
from replica.engine import build_engine
from replica.kv_sources import PrefixFetcher, build_tiers, page_format_of

PAGE_SIZE = 128


def load_method(path: str):
    spec = importlib.util.spec_from_file_location("disk_tier_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.DiskTier.load


def stored_prefixes(dtype: str, prefix_len: int, num_sets: int, folder: str):
    """The reader engine (one thread), its page format, and a disk tier in ``folder`` holding ``num_sets`` prefixes of
    ``prefix_len`` tokens with random KV (seeds 50, 51, ...): (reader, page_format, disk, [(keys, token slices)])."""
    torch.set_num_threads(1)
    ensure_model()
    reader = build_engine(engine_config(argparse.Namespace(dtype=dtype), "reader"))
    page_format = page_format_of(reader)
    template = page_template(reader, tokens(prefix_len, seed=0), PAGE_SIZE)
    (disk,) = build_tiers(page_format, redis_url=None, disk_cache_dir=folder, disk_budget_bytes=4 << 30)
    sets = []
    for index in range(num_sets):
        keys, slices, pages = random_pages(reader, template, tokens(prefix_len, seed=50 + index), PAGE_SIZE)
        PrefixFetcher(page_format, tiers=[disk]).store(pages)
        disk.flush(30)
        sets.append((keys, slices))
    return reader, page_format, disk, sets


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--sets", type=int, default=4, help="prefixes stored and loaded in turn")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--before", help="another disk_tier.py whose DiskTier.load is timed beside this one")
    parser.add_argument("--pool", action="store_true",
                        help="time the load with the copy into the pool against decrypting into the pool's pages")
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="prefixserve-disk-load-")
    try:
        reader, page_format, disk, sets = stored_prefixes(args.dtype, args.prefix_len, args.sets, folder)
        versions = {"this checkout": lambda keys, slices: disk.load(keys, slices)}
        if args.pool:  # with the write into the pool (page i of set s into its own pool page), as the engine does it
            runner = reader.runner
            first_page = {id(keys): index * len(keys) for index, (keys, _) in enumerate(sets)}

            def copied(keys, slices):
                loaded = disk.load(keys, slices)
                for offset, kv in enumerate(loaded):
                    runner.write_page(first_page[id(keys)] + offset, kv)
                return loaded

            def landed(keys, slices):
                start = first_page[id(keys)]
                return disk.load(keys, slices, [runner.read_page(start + offset) for offset in range(len(keys))])

            versions = {"load, then copy into the pool": copied, "load into the pool pages (landing)": landed}
        if args.before:
            before = load_method(args.before)
            versions["before"] = lambda keys, slices: before(disk, keys, slices)
        times = {name: [] for name in versions}
        names = list(versions)
        for round_ in range(args.rounds):
            keys, slices = sets[round_ % len(sets)]
            for name in names if round_ % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                loaded = versions[name](keys, slices)
                times[name].append(time.perf_counter() - start)
                assert len(loaded) == len(keys), name
        nbytes = len(sets[0][0]) * page_format.page_num_bytes
        print(f"\n{len(sets[0][0])} pages of {page_format.page_num_bytes / 2**20:.2f} MiB, {args.dtype}; medians of "
              f"{args.rounds} loads over {args.sets} stored prefixes\n")
        print("| load | median | min | GB/s (median) |\n|---|---|---|---|")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"| {name} | {median * 1e3:.2f} ms | {min(values) * 1e3:.2f} ms | {nbytes / median / 1e9:.2f} |")
        disk.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
