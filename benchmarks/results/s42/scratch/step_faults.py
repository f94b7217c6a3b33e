"""Probe: minor page faults and wall time of requests on one engine (cold 2112 tokens, warm 2048 cached + 64, the
64-token floor, a 12-token prompt), float32 / bfloat16 (session 42 scratch). argv: dtypes [mallopt]"""
import ctypes, resource, sys, time
import torch
from common.types import EngineRequest, SamplingParams
from replica.engine import build_engine
from replica.config import EngineConfig

if len(sys.argv) > 2 and sys.argv[2] == "mallopt":
    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    print("mallopt", libc.mallopt(M_MMAP_THRESHOLD, 32 << 20), libc.mallopt(M_TRIM_THRESHOLD, 512 << 20))
MODEL = "benchmarks/.scratch/tiny-llama-512x8"
flt = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for dtype in sys.argv[1].split(","):
    engine = build_engine(EngineConfig(model=MODEL, dtype=dtype, kv_cache_memory_bytes=256 << 20,
                                       max_num_batched_tokens=4096, max_model_len=4096, replica_id="probe"))
    g = torch.Generator().manual_seed(0)
    def run(prompt, tag):
        f = flt(); t = time.perf_counter()
        engine.add_request(EngineRequest(tag, prompt, SamplingParams(max_tokens=1, temperature=0.0)))
        while engine.has_work():
            engine.step()
        return "%.1f ms/%d" % ((time.perf_counter() - t) * 1e3, flt() - f)
    rows = {"cold 2112": [], "warm 2048+64": [], "floor 64": [], "short 12": []}
    for r in range(5):
        prefix = torch.randint(3, 8000, (2048,), generator=g).tolist()
        rows["cold 2112"].append(run(prefix + torch.randint(3, 8000, (64,), generator=g).tolist(), f"c{r}"))
        rows["warm 2048+64"].append(run(prefix + torch.randint(3, 8000, (64,), generator=g).tolist(), f"w{r}"))
        rows["floor 64"].append(run(torch.randint(3, 8000, (64,), generator=g).tolist(), f"f{r}"))
        rows["short 12"].append(run(torch.randint(3, 8000, (12,), generator=g).tolist(), f"s{r}"))
    for name, values in rows.items():
        print(dtype, name, " ".join(values), flush=True)
