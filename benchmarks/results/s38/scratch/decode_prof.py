# PYTHONPATH=. .venv/bin/python benchmarks/results/s38/scratch/decode_prof.py bfloat16|float32  (session 38 probe)
import sys, time, torch, statistics
from common.types import EngineRequest, SamplingParams
from replica.config import EngineConfig
from replica.engine import build_engine
dtype = sys.argv[1]
torch.set_num_threads(1)
e = build_engine(EngineConfig(model="benchmarks/.scratch/tiny-llama-512x8", dtype=dtype, kv_cache_memory_bytes=1 << 28, max_model_len=4096))
e.add_request(EngineRequest("a", list(range(100, 112)), SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)))
for _ in range(20): e.step()
ts = []
for _ in range(60):
    t = time.perf_counter(); e.step(); ts.append(time.perf_counter() - t)
print(dtype, "step median ms", round(statistics.median(ts) * 1000, 2))
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(20): e.step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=50))
