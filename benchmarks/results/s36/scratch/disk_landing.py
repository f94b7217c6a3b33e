"""Session 36 scratch: the disk tier's per-page work with 2 threads, three ways, interleaved round by round (the box
drifts): read_page_file into a reused contiguous tensor (the load alone), that followed by the pool write (the engine
before landing pages), and read_page_file decrypting straight into the pool page (landing pages, replica/landing.py).
16 float32 pages of the tiny Llama (2 MiB each). Medians of --rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/results/s36/scratch/disk_landing.py --rounds 40
"""
import argparse
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.disk_load import stored_prefixes
from replica.tiers import arrow_file


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="s36-disk-landing-")
    try:
        reader, page_format, disk, [(keys, slices)] = stored_prefixes(args.dtype, 2048, 1, folder)
        paths = [disk._path_of(disk.page_id(key)) for key in keys]
        outs = [torch.empty(page_format.kv_shape, dtype=getattr(torch, page_format.dtype)) for _ in keys]
        runner = reader.runner

        def load(i, out):
            return arrow_file.read_page_file(paths[i], page_format, disk._tier_key, keys[i], slices[i], out)

        phases = {
            "read_page_file (contiguous tensor)": lambda i: load(i, outs[i]),
            "read_page_file, then pool write": lambda i: runner.write_page(i, load(i, outs[i])),
            "read_page_file into the pool page": lambda i: load(i, runner.read_page(i)),
        }
        times = {name: [] for name in phases}
        executor = ThreadPoolExecutor(args.threads)
        for round_ in range(args.rounds):
            names = list(phases) if round_ % 2 == 0 else list(phases)[::-1]
            for name in names:
                start = time.perf_counter()
                list(executor.map(phases[name], range(len(keys))))
                times[name].append(time.perf_counter() - start)
        executor.shutdown()
        for index, key in enumerate(keys):  # the pages landed whole
            assert torch.equal(runner.read_page(index), outs[index]), key
        nbytes = len(keys) * page_format.page_num_bytes
        print(f"{len(keys)} pages, {nbytes / 2**20:.0f} MiB, {args.dtype}, {args.threads} threads, {args.rounds} rounds")
        for name, values in times.items():
            med = statistics.median(values)
            print(f"| {name} | {med * 1e3:.2f} ms | {min(values) * 1e3:.2f} ms | {nbytes / med / 1e9:.2f} GB/s |")
        disk.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
