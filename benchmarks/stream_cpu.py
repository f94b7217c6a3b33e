"""Where the CPU goes while a server streams: concurrent streams against a running server, and the CPU seconds each
process on this machine (and each thread of the busiest ones) spent meanwhile, from /proc. Linux only.

    .venv/bin/python benchmarks/stream_cpu.py --base-url http://127.0.0.1:8200 --model tiny-llama \
        [--streams 4] [--output-len 256] [--rounds 2]

Prints one JSON object: the streams' median TPOT (ms), the outputs they received, the wall time, and per process (its
command line, cut) the CPU seconds and CPU seconds per received output, with the threads of the top processes.
Thread names are what the OS shows (Ray renames many of its threads "ray::IDLE"); the thread ids match py-spy's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import httpx

from serving_overhead import prompt_of, stream_request


def cpu_snapshot() -> dict[tuple[str, str], tuple[str, str, int]]:
    """(pid, tid) -> (command line, thread name, CPU ticks) of every thread on the machine."""
    threads = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()[:70]
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = open(f"/proc/{pid}/task/{tid}/stat").read()
                name = stat[stat.index("(") + 1 : stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2 :].split()
                threads[(pid, tid)] = (command, name, int(fields[11]) + int(fields[12]))
        except (OSError, ValueError):
            continue  # ended meanwhile
    return threads


async def load(args) -> tuple[list[float], int]:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=300) as client:
        await stream_request(client, args.model, prompt_of(64, 1, args.vocab), 8)  # warm-up
        tpots = []
        for round_index in range(args.rounds):
            results = await asyncio.gather(*[
                stream_request(client, args.model, prompt_of(64, 900 + 10 * round_index + i, args.vocab),
                               args.output_len) for i in range(args.streams)])
            tpots.extend(tpot for _, tpot in results)
    return tpots, args.rounds * args.streams * args.output_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--top", type=int, default=4, help="processes whose threads are listed")
    args = parser.parse_args()
    before = cpu_snapshot()
    started = time.perf_counter()
    tpots, num_outputs = asyncio.run(load(args))
    wall = time.perf_counter() - started
    after = cpu_snapshot()
    hz = os.sysconf("SC_CLK_TCK")
    process_to_s: dict[tuple[str, str], float] = {}
    thread_to_s: dict[tuple[str, str], list[tuple[float, str, str]]] = {}
    for (pid, tid), (command, name, ticks) in after.items():
        spent = (ticks - before.get((pid, tid), ("", "", 0))[2]) / hz
        if spent > 0:
            process_to_s[(pid, command)] = process_to_s.get((pid, command), 0.0) + spent
            thread_to_s.setdefault((pid, command), []).append((spent, tid, name))
    top = sorted(process_to_s.items(), key=lambda item: -item[1])[:12]
    result = {
        "streams": args.streams, "outputs": num_outputs, "wall_s": round(wall, 2),
        "median_tpot_ms": round(statistics.median(tpots), 2),
        "processes": [{"pid": pid, "command": command, "cpu_s": round(seconds, 2),
                       "cpu_ms_per_output": round(1000 * seconds / num_outputs, 3)} for (pid, command), seconds in top],
        "threads": {f"{pid} {command}": [{"tid": tid, "name": name, "cpu_s": round(seconds, 2)}
                                         for seconds, tid, name in sorted(thread_to_s[(pid, command)])[::-1][:4]]
                    for (pid, command), _ in top[: args.top]},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
