"""What bounds a shared-tier load, below the tiers' own code (BENCHMARKS.md section 0b, "KV transfers").

1. AES-GCM decryption of 16 float32 pages (2 MiB each, 32 MiB) into: one reused block, a fresh tensor per page, or
   one fresh 32 MiB block per load (what the tiers did before session 10: glibc maps a block that large anew every
   time, so every decrypted byte pays a page fault); then the per-page case on 1 and 2 threads (decryption releases
   the GIL).
2. A raw ``MGET`` of 32 MiB from a private ``redis-server`` (nothing decrypted), read with the Redis tier's own reply
   reader, for values of 2 MiB down to 16 KiB: wall time, and the server's CPU time per ``MGET`` from /proc.

    PYTHONPATH=. .venv/bin/python benchmarks/tier_transfer_floor.py [--rounds 8]
Best of ``--rounds`` for part 1, mean of 20 ``MGET``s for part 2; GB/s = bytes / time.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import redis
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from replica.tiers.redis_tier import ReplyReader, reply_buffer

PAGE_BYTES = 2 << 20
NUM_PAGES = 16
TOTAL = PAGE_BYTES * NUM_PAGES


def decryption(rounds: int) -> None:
    aead, nonce = AESGCM(os.urandom(32)), os.urandom(12)
    sealed = [aead.encrypt(nonce, os.urandom(PAGE_BYTES), b"ad") for _ in range(NUM_PAGES)]
    reused = torch.empty(NUM_PAGES, PAGE_BYTES // 4)

    def open_into(index: int, out: torch.Tensor) -> None:
        aead.decrypt_into(nonce, sealed[index], b"ad", out.view(torch.uint8).numpy())

    def one_reused_block() -> None:
        for index in range(NUM_PAGES):
            open_into(index, reused[index])

    def a_tensor_per_page() -> None:
        for index in range(NUM_PAGES):
            open_into(index, torch.empty(PAGE_BYTES // 4))

    def a_fresh_block_per_load() -> None:
        block = torch.empty(NUM_PAGES, PAGE_BYTES // 4)
        for index in range(NUM_PAGES):
            open_into(index, block[index])

    pool = ThreadPoolExecutor(2)

    def a_tensor_per_page_two_threads() -> None:
        list(pool.map(lambda index: open_into(index, torch.empty(PAGE_BYTES // 4)), range(NUM_PAGES)))

    print(f"| AES-GCM decryption of {NUM_PAGES} x 2 MiB, into | GB/s (best of {rounds}) |")
    print("|---|---|")
    for name, run in (("one reused block", one_reused_block), ("a fresh tensor per page", a_tensor_per_page),
                      ("one fresh 32 MiB block per load", a_fresh_block_per_load),
                      ("a fresh tensor per page, 2 threads", a_tensor_per_page_two_threads)):
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        print(f"| {name} | {TOTAL / best / 1e9:.2f} |")
    pool.shutdown()


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raw_mget() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        buffer = reply_buffer(PAGE_BYTES + (1 << 20))
        print(f"\n| raw MGET of 32 MiB, value size | wall ms | GB/s | redis-server CPU ms per MGET |")
        print("|---|---|---|---|")
        for size in (PAGE_BYTES, 512 << 10, 128 << 10, 16 << 10):
            keys = [f"v{size}-{i}" for i in range(TOTAL // size)]
            value = os.urandom(size)
            for key in keys:
                client.set(key, value)
            connection = client.connection_pool.get_connection()
            num_calls, cpu_before, start = 20, cpu_seconds(server.pid), time.perf_counter()
            for _ in range(num_calls):
                connection.send_command("MGET", *keys)
                reader = ReplyReader(connection._sock, buffer)
                for _ in range(reader.array_length()):
                    reader.bulk(PAGE_BYTES + 64)
            wall = (time.perf_counter() - start) / num_calls
            server_cpu = (cpu_seconds(server.pid) - cpu_before) / num_calls
            client.connection_pool.release(connection)
            print(f"| {size >> 10} KiB x {len(keys)} | {wall * 1e3:.1f} | {TOTAL / wall / 1e9:.2f} | "
                  f"{server_cpu * 1e3:.1f} |")
    finally:
        server.terminate()
        server.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    decryption(args.rounds)
    raw_mget()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
