"""What a hop to a one-thread executor costs an asyncio (uvloop) handler: await run_in_executor of a trivial function,
2000 times after 200 warm-up hops, against the same call inline.
    .venv/bin/python benchmarks/results/s40/scratch/executor_hop.py"""
import asyncio, concurrent.futures, time
import uvloop

pool = concurrent.futures.ThreadPoolExecutor(1)


def f(x):
    return x


async def main():
    loop = asyncio.get_running_loop()
    for _ in range(200):
        await loop.run_in_executor(pool, f, 1)
    hops = []
    for _ in range(2000):
        t = time.perf_counter(); await loop.run_in_executor(pool, f, 1); hops.append(time.perf_counter() - t)
    inline = []
    for _ in range(2000):
        t = time.perf_counter(); f(1); inline.append(time.perf_counter() - t)
    hops.sort(); inline.sort()
    print(f"hop median {hops[1000] * 1e6:.1f} us, p90 {hops[1800] * 1e6:.1f} us; inline median {inline[1000] * 1e6:.2f} us")


uvloop.run(main())
