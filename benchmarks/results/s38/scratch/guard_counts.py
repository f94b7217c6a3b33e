# PYTHONPATH=. .venv/bin/python benchmarks/results/s38/scratch/guard_counts.py  (session 38 probe)
import collections, torch
from replica import compile as c
orig = c.skip_module_tensor_guards
def spy(entries):
    counts = collections.Counter((e.guard_type, e.orig_guard.source.is_unspecialized_nn_module()) for e in entries)
    for k, v in sorted(counts.items(), key=lambda kv: -kv[1]): print("GUARD", k, v)
    ex = [e.name for e in entries if e.orig_guard.source.is_unspecialized_nn_module() and e.guard_type != "TENSOR_MATCH"][:12]
    print("GUARD examples", ex)
    return orig(entries)
c.skip_module_tensor_guards = spy
from replica.config import EngineConfig
from replica.engine import build_engine
build_engine(EngineConfig(model="benchmarks/.scratch/tiny-llama-512x8", dtype="bfloat16", kv_cache_memory_bytes=1 << 28, max_model_len=4096))
