"""Where the CPU goes during sequential short requests (12 tokens in, 1 out): per-thread CPU ticks from /proc.
PYTHONPATH=benchmarks .venv/bin/python benchmarks/results/s40/scratch/short_cpu.py URL N"""
import sys, time, json, statistics, os
import httpx
from stream_cpu import cpu_snapshot

url, n = sys.argv[1], int(sys.argv[2])
tick = os.sysconf("SC_CLK_TCK")
def prompt(i):
    return [(i * 7919 + k * 104729) % 8000 + 100 for k in range(12)]
with httpx.Client(base_url=url, timeout=60) as c:
    for i in range(20):
        c.post("/v1/completions", json={"model": "tiny-llama", "prompt": prompt(i), "max_tokens": 1, "temperature": 0})
    before = cpu_snapshot(); t0 = time.perf_counter(); walls = []
    for i in range(n):
        s = time.perf_counter()
        r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": prompt(1000 + i), "max_tokens": 1,
                                            "temperature": 0})
        r.raise_for_status(); walls.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0; after = cpu_snapshot()
rows = []
for key, (cmd, name, ticks) in after.items():
    d = ticks - before.get(key, (cmd, name, 0))[2]
    if d > 0:
        rows.append((d, key[0], key[1], cmd[:60], name))
rows.sort(reverse=True)
print(f"requests {n} wall {wall:.2f} s, median {statistics.median(walls)*1e3:.2f} ms, mean {statistics.mean(walls)*1e3:.2f}")
print(f"total CPU {sum(r[0] for r in rows)/tick:.2f} s = {sum(r[0] for r in rows)/tick/wall:.2f} cores")
for d, pid, tid, cmd, name in rows[:25]:
    print(f"{d/tick:6.2f} s {d/tick/n*1e3:6.2f} ms/req  {pid}/{tid} {name:20s} {cmd}")
