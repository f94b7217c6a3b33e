# PYTHONPATH=. .venv/bin/python benchmarks/results/s39/scratch/after_workload.py D on|off: a 12-token request in process (median of 60) before and after a prefix_repetition-like workload (4 prefixes x 1536 + 256, 64 out, 48 prompts, 4 at a time), caching on or off (session 39 probe)
import random, statistics, sys, time, torch
from common.types import EngineRequest, SamplingParams
from replica.config import EngineConfig
from replica.engine import build_engine
dtype, caching = sys.argv[1], sys.argv[2] == "on"
e = build_engine(EngineConfig(model="benchmarks/.scratch/tiny-llama-512x8", dtype=dtype, kv_cache_memory_bytes=2 << 30,
                              max_model_len=4096, num_threads=1, num_prefill_threads=2, enable_prefix_caching=caching))
n = [0]
def short():
    n[0] += 1
    e.add_request(EngineRequest(f"s{n[0]}", [100 + (n[0] * 7 + j) % 8000 for j in range(12)], SamplingParams(max_tokens=1, temperature=0.0)))
    t = time.perf_counter()
    while e.has_work(): e.step()
    return (time.perf_counter() - t) * 1000
def block(tag):
    for _ in range(10): short()
    ts = [short() for _ in range(60)]
    print(f"{tag}: 12-token request median {statistics.median(ts):.2f} ms, p90 {sorted(ts)[54]:.2f}", flush=True)
block("before")
rng = random.Random(0)
prefixes = [[rng.randrange(100, 8000) for _ in range(1536)] for _ in range(4)]
prompts = [prefixes[i % 4] + [rng.randrange(100, 8000) for _ in range(256)] for i in range(48)]
t = time.perf_counter()
queue = list(enumerate(prompts)); live = 0
while queue or e.has_work():
    while queue and len(e.scheduler.running) + len(e.scheduler.waiting) < 4:
        i, p = queue.pop(0)
        e.add_request(EngineRequest(f"w{i}", p, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)))
    e.step()
print(f"workload: {time.perf_counter() - t:.1f} s", flush=True)
block("after")
time.sleep(10)
block("after 10 s idle")
