# PYTHONPATH=. .venv/bin/python benchmarks/results/s38/scratch/short_prof.py bfloat16|float32  (session 38 probe)
import sys, time, torch, statistics
from common.types import EngineRequest, SamplingParams
from replica.config import EngineConfig
from replica.engine import build_engine
dtype = sys.argv[1]
torch.set_num_threads(1)
e = build_engine(EngineConfig(model="benchmarks/.scratch/tiny-llama-512x8", dtype=dtype, kv_cache_memory_bytes=1 << 28, max_model_len=4096, num_prefill_threads=2))
def one(i):
    e.add_request(EngineRequest(f"r{i}", [100 + (i * 7 + j) % 8000 for j in range(12)], SamplingParams(max_tokens=1, temperature=0.0)))
    t = time.perf_counter()
    while e.has_work(): e.step()
    return time.perf_counter() - t
for i in range(20): one(i)
ts = [one(100 + i) for i in range(60)]
print(dtype, "12-token request in process, median ms", round(statistics.median(ts) * 1000, 2))
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for i in range(20): one(500 + i)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=50))
