# PYTHONPATH=. .venv/bin/python benchmarks/results/s39/scratch/short_threads.py D: a 12-token request in process, the engine with 1 decode and 2 prefill threads, PREFILL_THREADS_MIN_TOKENS 64 (12 tokens on 1 thread) against 8 (on 2), alternating, median of 60 (session 39 probe)
import sys, time, torch, statistics
from common.types import EngineRequest, SamplingParams
from replica.config import EngineConfig
import replica.engine as E
from replica.engine import build_engine
dtype = sys.argv[1]
e = build_engine(EngineConfig(model="benchmarks/.scratch/tiny-llama-512x8", dtype=dtype, kv_cache_memory_bytes=1 << 28, max_model_len=4096, num_threads=1, num_prefill_threads=2))
def one(i):
    e.add_request(EngineRequest(f"r{i}", [100 + (i * 7 + j) % 8000 for j in range(12)], SamplingParams(max_tokens=1, temperature=0.0)))
    t = time.perf_counter()
    while e.has_work(): e.step()
    return time.perf_counter() - t
for rnd in range(3):
    for thr in (64, 8):
        E.PREFILL_THREADS_MIN_TOKENS = thr
        for i in range(10): one(1000 * rnd + thr * 10 + i)
        ts = [one(100000 + 1000 * rnd + thr * 100 + i) for i in range(60)]
        print(dtype, f"min tokens {thr}: 12-token request median ms", round(statistics.median(ts) * 1000, 2), flush=True)
