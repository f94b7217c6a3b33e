"""Session 35 scratch: would opening a page file from a mapping of it (no read into a buffer) reach 2 GB/s? Session
34's phases (disk_phases.py) plus: the file mapped (MADV_POPULATE_READ, which fails instead of a later SIGBUS where a
page cannot be read), parsed and opened from the mapping into a reused page tensor; and that followed by the pool
write, against today's read_page_file followed by the pool write. Medians of --rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/results/s35/scratch/disk_mmap.py --rounds 30
"""
import mmap
import os
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
    folder = tempfile.mkdtemp(prefix="s35-disk-mmap-")
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

        from replica.tiers.codec import open_payload

        def mapped(i):
            fd = os.open(paths[i], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
                    mm.madvise(22)  # MADV_POPULATE_READ (Linux 5.14)
                    view = memoryview(mm)
                    try:
                        reader = ipc.open_file(pa.BufferReader(pa.py_buffer(view)))
                        metadata = reader.schema.metadata
                        batch = reader.get_batch(0)
                        batch.validate(full=True)
                        column = batch.column(0)
                        _, offsets, values = column.buffers()
                        start, end = memoryview(offsets).cast("q")[0:2]
                        open_payload(metadata[arrow_file.HEADER_METADATA_KEY], page_format, disk._tier_key, keys[i],
                                     slices[i], memoryview(values).cast("B")[start:end], outs[i])
                        del reader, batch, column, offsets, values
                    finally:
                        view.release()
            finally:
                os.close(fd)

        def whole_then_pool(i):
            whole(i)
            pool_write(i)

        def mapped_then_pool(i):
            mapped(i)
            pool_write(i)

        phases = {"mapped open": mapped, "read_page_file+pool": whole_then_pool, "mapped open+pool": mapped_then_pool,
                  "read": read_only, "read+parse(full)": parse,
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
