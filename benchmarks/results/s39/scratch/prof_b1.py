# PYTHONPATH=. .venv/bin/python benchmarks/results/s39/scratch/prof_b1.py: the linear calls of 10 float32 decode steps of one sequence, by shape (session 39 probe)
import torch, collections
from torch.profiler import profile, ProfilerActivity
from common.types import EngineRequest, SamplingParams
from replica.config import EngineConfig
from replica.engine import build_engine
torch.set_num_threads(1)
e = build_engine(EngineConfig(model="benchmarks/.scratch/tiny-llama-512x8", dtype="float32", kv_cache_memory_bytes=1<<30, num_threads=1))
e.add_request(EngineRequest("a", list(range(100,112)), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)))
for _ in range(8): e.step()
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
    for _ in range(10): e.step()
c = collections.Counter()
for ev in p.events():
    if "linear" in ev.name or "mm" in ev.name:
        c[(ev.name, str(ev.input_shapes[:2]))] += 1
for k, v in c.most_common(20): print(v, k)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
