"""Session 34 scratch: where a disk-tier load's time goes. 16 float32 pages stored, then per page on 1 and 2 threads:
the file read alone, read + Arrow parse (with and without full validation), the AES-GCM open alone (of an in-memory
copy, under a scratch key), the whole read_page_file (read, parse, open into a reused page tensor), and the write
into the pool. Medians of --rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/results/s34/scratch/disk_phases.py --rounds 30
"""
import argparse
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.kv_sources import engine_config, ensure_model, page_template, random_pages, tokens
from replica.engine import build_engine
from replica.kv_sources import PrefixFetcher, build_tiers, page_format_of
from replica.tiers import arrow_file


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ensure_model()
    reader = build_engine(engine_config(args, "reader"))
    page_format = page_format_of(reader)
    template = page_template(reader, tokens(2048, seed=0), 128)
    folder = tempfile.mkdtemp(prefix="s34-disk-phases-")
    try:
        (disk,) = build_tiers(page_format, redis_url=None, disk_cache_dir=folder, disk_budget_bytes=4 << 30)
        keys, slices, pages = random_pages(reader, template, tokens(2048, seed=50), 128)
        PrefixFetcher(page_format, tiers=[disk]).store(pages)
        disk.flush(30)
        paths = [disk._path_of(disk.page_id(key)) for key in keys]
        max_bytes = arrow_file.max_file_bytes(page_format)
        outs = [torch.empty(page_format.kv_shape, dtype=getattr(torch, page_format.dtype)) for _ in keys]
        pool = reader.runner.kv_cache

        def read_only(i):
            arrow_file.read_file_safely(paths[i], max_bytes, into=arrow_file.scratch_buffer(max_bytes))

        def whole(i):
            arrow_file.read_page_file(paths[i], page_format, disk._tier_key, keys[i], slices[i], outs[i])

        def pool_write(i):
            reader.runner.write_page(i, outs[i])

        import pyarrow as pa
        from pyarrow import ipc

        def parse(i, full=True):
            data = arrow_file.read_file_safely(paths[i], max_bytes, into=arrow_file.scratch_buffer(max_bytes))
            batch = ipc.open_file(pa.BufferReader(pa.py_buffer(data))).get_batch(0)
            batch.validate(full=full)

        sealed = []
        for i in range(len(keys)):
            data = bytes(arrow_file.read_file_safely(paths[i], max_bytes, into=arrow_file.scratch_buffer(max_bytes)))
            batch = ipc.open_file(pa.BufferReader(pa.py_buffer(data))).get_batch(0)
            _, offsets, values = batch.column(0).buffers()
            start, end = memoryview(offsets).cast("q")[0:2]
            sealed.append(bytes(memoryview(values).cast("B")[start:end]))
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        aead = AESGCM(b"k" * 32)
        nonce = b"n" * 12
        plain = [aead.encrypt(nonce, bytes(s[:-16]), b"ad") for s in sealed]

        def decrypt(i):
            aead.decrypt_into(nonce, plain[i], b"ad", outs[i].view(-1).view(torch.uint8).numpy())

        phases = {"read": read_only, "read+parse(full)": parse,
                  "read+parse(not full)": lambda i: parse(i, False), "decrypt alone": decrypt,
                  "read+parse+decrypt": whole, "pool write": pool_write}
        for threads in (1, 2):
            executor = ThreadPoolExecutor(threads)
            for name, fn in phases.items():
                times = []
                for _ in range(args.rounds):
                    start = time.perf_counter()
                    list(executor.map(fn, range(len(keys))))
                    times.append(time.perf_counter() - start)
                med = statistics.median(times)
                print(f"{threads} thread(s) {name:20s} median {med * 1e3:6.2f} ms min {min(times) * 1e3:6.2f} ms "
                      f"{len(keys) * page_format.page_num_bytes / med / 1e9:.2f} GB/s")
            executor.shutdown()
        disk.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
