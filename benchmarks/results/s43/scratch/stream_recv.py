"""The page stream's receive side alone: a holder process serves 16 pages of the tiny Llama's shape (8 layers, 128
tokens, 4 KV heads, head dim 64) from a SharedPool over loopback TCP; the receiver fetches them into fresh slots, or
into a pool's pages (landing views, 2 x layers runs each), timed over 40 fetches.

    PYTHONPATH=. .venv/bin/python benchmarks/results/s43/scratch/stream_recv.py [bfloat16|float32]
"""
import multiprocessing as mp
import statistics
import sys
import time

import torch

from replica.page_stream import StreamClient
from replica.shared_pool import SharedPool

LAYERS, PAGE, HEADS, DIM, PAGES = 8, 128, 4, 64, 16


def holder(q, dtype_name):
    dtype = getattr(torch, dtype_name)
    pool = SharedPool((LAYERS, 2, 40, PAGE, HEADS, DIM), dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape).to(dtype))
    keys = [bytes([n + 1]) * 32 for n in range(PAGES)]
    ids = list(range(3, 3 + PAGES))

    def answer(asked):
        held = [key for key, _ in zip(keys, asked)]
        page_ids = ids[:len(held)]
        return pool.bundle(held, [list(range(PAGE))] * len(held), page_ids, pool.generations[page_ids].tolist())

    pool.serve_stream(answer, "127.0.0.1")
    q.put(pool.stream_location)
    time.sleep(3600)


def receive_scattered(sock, buffers):
    """Fill ``buffers`` in order with ``recvmsg_into`` (up to 1024 at a time): one call per arrival, not per buffer."""
    index = 0
    buffers = list(buffers)
    while index < len(buffers):
        count = sock.recvmsg_into(buffers[index:index + 1024])[0]
        if count == 0:
            raise ConnectionError("closed")
        while count:
            size = len(buffers[index])
            if count >= size:
                count -= size
                index += 1
            else:
                buffers[index] = buffers[index][count:]
                count = 0


def scattered_fetch(client, location, keys, out, pending, plain):
    """``StreamClient.fetch`` with the page runs gathered first and received with ``receive_scattered``: the answer's
    last 4 bytes (the valid count) are read after them, so the gathering must not read them early."""
    from replica import page_stream

    pending.clear()
    sock = client._connection(location)
    sock.sendall(page_stream._HEADER.pack(page_stream.REQUEST_MAGIC, len(keys)) + b"".join(keys))
    original_receive = page_stream._receive
    state = {"runs_done": False}

    def receive(sock_, size):
        if pending and not state["runs_done"]:
            receive_scattered(sock_, pending)
            state["runs_done"] = True
        return original_receive(sock_, size)

    page_stream._receive = receive
    try:
        found, _tokens, pages, _ = client._read_answer(sock, keys, out)
    finally:
        page_stream._receive = original_receive
    client._release(location, sock)
    return found, pages


def main():
    dtype_name = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
    dtype = getattr(torch, dtype_name)
    q = mp.Queue()
    p = mp.Process(target=holder, args=(q, dtype_name), daemon=True)
    p.start()
    location = q.get()
    keys = [bytes([n + 1]) * 32 for n in range(PAGES)]
    client = StreamClient(timeout_s=10)
    pool = torch.zeros((LAYERS, 2, 64, PAGE, HEADS, DIM), dtype=dtype)
    from replica import page_stream

    plain = page_stream.receive_into
    for rnd in range(2):
        for mode in ("slots", "landing (every other page)", "landing (consecutive pages)",
                     "landing (every other page), recvmsg_into"):
            page_stream.receive_into = plain
            if "recvmsg" in mode:  # an experiment: the whole answer's runs in few calls
                pending = []

                def collect(sock, view):
                    pending.append(view)
                    return True

                page_stream.receive_into = collect
            times = []
            for _ in range(40):
                out = None
                if mode.startswith("landing"):
                    step = 2 if "other" in mode else 1
                    out = [pool[:, :, 5 + step * n] for n in range(PAGES)]
                start = time.perf_counter()
                if "recvmsg" in mode:
                    found, pages = scattered_fetch(client, location, keys, out, pending, plain)
                else:
                    found, _tokens, pages, _ = client.fetch(location, keys, out)
                times.append(time.perf_counter() - start)
                assert len(found) == PAGES
                del pages
            med = statistics.median(times[5:])
            nbytes = PAGES * LAYERS * 2 * PAGE * HEADS * DIM * dtype.itemsize
            print(f"{dtype_name} {mode}: median {med * 1000:.2f} ms ({nbytes / med / 1e9:.2f} GB/s), "
                  f"min {min(times) * 1000:.2f} ms")
    page_stream.receive_into = plain
    client.close()
    # the same through the replicas' peer client (its executor thread and event loop), into landing pages
    import asyncio

    from replica.landing import LandingPages
    from replica.peer_copy import ServePeerClient

    peer = ServePeerClient("unused", "unused", timeout_s=10, handle=object())
    peer.node_id = None
    location_node = location
    assert peer.learn_stream("holder", location_node) or True
    peer._streams["holder"] = location
    loop = asyncio.new_event_loop()
    for rnd in range(2):
        times = []
        for _ in range(40):
            views = [pool[:, :, 5 + n] for n in range(PAGES)]
            landing = LandingPages(list(range(PAGES)), views, lambda _: None)
            start = time.perf_counter()
            got = loop.run_until_complete(peer.fetch("holder", keys, landing))
            times.append(time.perf_counter() - start)
            assert len(got) == PAGES and got[0].landing_page is not None
            del got
        med = statistics.median(times[5:])
        print(f"{dtype_name} ServePeerClient.fetch into landing pages: median {med * 1000:.2f} ms, "
              f"min {min(times) * 1000:.2f} ms")
    peer.close()
    loop.close()
    p.kill()


if __name__ == "__main__":
    main()
