# PYTHONPATH=. .venv/bin/python benchmarks/results/s38/scratch/decode_cprof.py bfloat16: cProfile of 100 decode steps (1 sequence), by own time  (session 38 probe)
import sys, time, torch, cProfile, pstats
from common.types import EngineRequest, SamplingParams
from replica.config import EngineConfig
from replica.engine import build_engine
torch.set_num_threads(1)
e = build_engine(EngineConfig(model="benchmarks/.scratch/tiny-llama-512x8", dtype=sys.argv[1], kv_cache_memory_bytes=1 << 28, max_model_len=4096))
e.add_request(EngineRequest("a", list(range(100, 112)), SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)))
for _ in range(20): e.step()
pr = cProfile.Profile(); pr.enable()
for _ in range(100): e.step()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
