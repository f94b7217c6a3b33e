"""What bounds a shared-tier load, below the tiers' own code (BENCHMARKS.md section 0b, "KV transfers").

1. AES-GCM decryption of 16 float32 pages (2 MiB each, 32 MiB) into: one reused block, a fresh tensor per page, or
   one fresh 32 MiB block per load (what the tiers did before session 10: glibc maps a block that large anew every
   time, so every decrypted byte pays a page fault); then the per-page case on 1 and 2 threads (decryption releases
   the GIL).
2. A raw ``MGET`` of 32 MiB from a private ``redis-server`` (nothing decrypted), read with the Redis tier's own reply
   reader, for values of 2 MiB down to 16 KiB: wall time, and the server's CPU time per ``MGET`` from /proc.
3. The same for 16 values of 1 MiB (a bfloat16 prefix of 2048 tokens) split over 1, 2, 4 and 8 connections read at
   once, a thread each: whether more connections get more out of ``redis-server`` (7.0 writes at most 64 KiB to a
   client per pass of its event loop, so one reply of 16 MiB takes ~256 passes).
4. 16 MiB sent as 256 pieces of 64 KiB (a page's per-layer K and V slices, as a holder would send them straight out
   of its pool) over a loopback TCP connection and over a Unix stream socket, received into one buffer: the floor of
   any socket transfer between two processes on this box, e.g. a direct holder-to-receiver path between nodes.

    PYTHONPATH=. .venv/bin/python benchmarks/tier_transfer_floor.py [--rounds 8]
Best of ``--rounds`` for part 1, mean of 20 ``MGET``s for part 2, medians of 20 for parts 3 and 4; GB/s = bytes /
time.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import threading
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


def private_redis() -> tuple[subprocess.Popen, redis.Redis]:
    """A redis-server on a free port (no persistence) and a client that has reached it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return server, client


def read_mget(connection, keys: list[str], buffer: bytearray, max_value: int) -> None:
    connection.send_command("MGET", *keys)
    reader = ReplyReader(connection._sock, buffer)
    for _ in range(reader.array_length()):
        reader.bulk(max_value)


def raw_mget() -> None:
    server, client = private_redis()
    try:
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
                read_mget(connection, keys, buffer, PAGE_BYTES + 64)
            wall = (time.perf_counter() - start) / num_calls
            server_cpu = (cpu_seconds(server.pid) - cpu_before) / num_calls
            client.connection_pool.release(connection)
            print(f"| {size >> 10} KiB x {len(keys)} | {wall * 1e3:.1f} | {TOTAL / wall / 1e9:.2f} | "
                  f"{server_cpu * 1e3:.1f} |")
    finally:
        server.terminate()
        server.wait()


def mget_connections(rounds: int = 20) -> None:
    value_bytes, num_values = 1 << 20, 16
    server, client = private_redis()
    try:
        keys = [f"c{i}" for i in range(4 * num_values)]
        for key in keys:
            client.set(key, os.urandom(value_bytes))
        print(f"\n| raw MGET of {num_values} x 1 MiB split over N connections, a thread each | median ms | GB/s | "
              f"redis-server CPU ms per load |")
        print("|---|---|---|---|")
        for num_connections in (1, 2, 4, 8):
            connections = [client.connection_pool.get_connection() for _ in range(num_connections)]
            buffers = [bytearray(4 << 20) for _ in range(num_connections)]
            walls, cpu_before = [], cpu_seconds(server.pid)
            with ThreadPoolExecutor(num_connections) as pool:
                for round_ in range(rounds):
                    load = keys[(round_ % 4) * num_values:][:num_values]
                    start = time.perf_counter()
                    parts = [pool.submit(read_mget, connections[i], load[i::num_connections], buffers[i],
                                         value_bytes + 64) for i in range(num_connections)]
                    for part in parts:
                        part.result()
                    walls.append(time.perf_counter() - start)
            server_cpu = (cpu_seconds(server.pid) - cpu_before) / rounds
            for connection in connections:
                client.connection_pool.release(connection)
            wall = statistics.median(walls)
            print(f"| {num_connections} | {wall * 1e3:.1f} | {num_values * value_bytes / wall / 1e9:.2f} | "
                  f"{server_cpu * 1e3:.1f} |")
    finally:
        server.terminate()
        server.wait()


def socket_streams(rounds: int = 20) -> None:
    piece, num_pieces = 64 << 10, 256
    source = bytearray(os.urandom(piece)) * num_pieces
    pieces = [memoryview(source)[i * piece:(i + 1) * piece] for i in range(num_pieces)]
    total = piece * num_pieces

    def send_all(sock: socket.socket) -> None:
        while sock.recv(1):  # one byte asks for the next 16 MiB
            remaining = list(pieces)
            while remaining:
                sent = sock.sendmsg(remaining[:1024])
                while sent:
                    if sent >= len(remaining[0]):
                        sent -= len(remaining.pop(0))
                    else:
                        remaining[0], sent = remaining[0][sent:], 0

    print(f"\n| 16 MiB as {num_pieces} pieces of 64 KiB (sendmsg), into one buffer (recv_into) | median ms | GB/s |")
    print("|---|---|---|")
    for name, family, address in (("TCP, loopback", socket.AF_INET, ("127.0.0.1", 0)),
                                  ("Unix stream socket", socket.AF_UNIX, f"\0prefixserve-floor-{os.getpid()}")):
        with socket.socket(family, socket.SOCK_STREAM) as listener:
            listener.bind(address)
            listener.listen(1)
            receiver = socket.socket(family, socket.SOCK_STREAM)
            receiver.connect(listener.getsockname())
            sender, _ = listener.accept()
        if family == socket.AF_INET:
            for sock in (receiver, sender):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        thread = threading.Thread(target=send_all, args=(sender,), daemon=True)
        thread.start()
        buffer = memoryview(bytearray(total))
        walls = []
        for _ in range(rounds + 2):
            start = time.perf_counter()
            receiver.sendall(b"x")
            received = 0
            while received < total:
                received += receiver.recv_into(buffer[received:])
            walls.append(time.perf_counter() - start)
        receiver.close()
        thread.join()
        sender.close()
        wall = statistics.median(walls[2:])
        print(f"| {name} | {wall * 1e3:.1f} | {total / wall / 1e9:.2f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    decryption(args.rounds)
    raw_mget()
    mget_connections()
    socket_streams()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
