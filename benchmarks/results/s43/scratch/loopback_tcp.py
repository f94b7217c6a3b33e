"""Loopback TCP throughput for a 16 MiB transfer between two processes, as the page stream does it (sendmsg of
64 KiB-1 MiB slices, recv_into one buffer), with the kernel's buffer autotuning or fixed SO_SNDBUF / SO_RCVBUF.

    .venv/bin/python benchmarks/results/s43/scratch/loopback_tcp.py
"""
import multiprocessing as mp
import socket
import statistics
import time

import numpy as np

SIZE = 16 << 20


def server(port_q, sndbuf, chunk, rounds):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port_q.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if sndbuf:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    data = np.random.randint(0, 255, SIZE, dtype=np.uint8)
    views = [memoryview(data[i:i + chunk]) for i in range(0, SIZE, chunk)]
    for _ in range(rounds):
        conn.recv(1)
        index = 0
        while index < len(views):
            sent = conn.sendmsg(views[index:index + 1024])
            while sent:
                if sent >= len(views[index]):
                    sent -= len(views[index])
                    index += 1
                else:
                    views[index] = views[index][sent:]
                    sent = 0
        views = [memoryview(data[i:i + chunk]) for i in range(0, SIZE, chunk)]
    conn.close()


def run(sndbuf, rcvbuf, chunk, rounds=30):
    q = mp.Queue()
    p = mp.Process(target=server, args=(q, sndbuf, chunk, rounds))
    p.start()
    sock = socket.create_connection(("127.0.0.1", q.get()))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    out = np.empty(SIZE, dtype=np.uint8)
    view = memoryview(out)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        sock.send(b"x")
        got = 0
        while got < SIZE:
            got += sock.recv_into(view[got:])
        times.append(time.perf_counter() - start)
    p.join()
    sock.close()
    med = statistics.median(times[3:])
    print(f"sndbuf={sndbuf >> 10 if sndbuf else 'auto'}K rcvbuf={rcvbuf >> 10 if rcvbuf else 'auto'}K "
          f"chunk={chunk >> 10}K: median {med * 1000:.2f} ms = {SIZE / med / 1e9:.2f} GB/s, min {min(times) * 1000:.2f}")


if __name__ == "__main__":
    for _ in range(2):
        for sndbuf, rcvbuf in ((0, 0), (4 << 20, 4 << 20), (0, 4 << 20), (2 << 20, 2 << 20)):
            run(sndbuf, rcvbuf, 64 << 10)
