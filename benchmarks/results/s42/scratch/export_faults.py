"""Probe: the holder's copy of a prefix's pages into one contiguous tensor (a host bundle, peer copy through the object
store): wall time and this process's minor page faults, float32 and bfloat16, 16 pages (session 42 scratch)."""
import resource, sys, time
import torch
from common.types import EngineRequest, SamplingParams
from replica.engine import build_engine
from replica.config import EngineConfig

MODEL = "benchmarks/.scratch/tiny-llama-512x8"
for dtype in sys.argv[1].split(","):
    engine = build_engine(EngineConfig(model=MODEL, dtype=dtype, kv_cache_memory_bytes=256 << 20,
                                       max_num_batched_tokens=4096, max_model_len=4096, replica_id="probe"))
    prompt = list(range(1, 2049))
    engine.add_request(EngineRequest("p", prompt, SamplingParams(max_tokens=1, temperature=0.0)))
    while engine.has_work():
        engine.step()
    keys = engine.page_keys(prompt)
    rows = []
    for _ in range(6):
        f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        pages = engine.export_pages_concurrently(keys, contiguous=True)
        rows.append("%.1f ms/%d" % ((time.perf_counter() - t) * 1e3, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f))
        del pages
    print(dtype, len(keys), "pages:", " ".join(rows), flush=True)
