import time, torch
from replica import model_runner
from replica.config import EngineConfig
from replica.engine import build_engine
orig_run = model_runner.ModelRunner.run
def timed(self, chunks):
    t = time.perf_counter(); out = orig_run(self, chunks)
    if getattr(self, "_compiled", None) is not None and not getattr(self, "_done", False):
        print(f"run on {torch.get_num_threads()} thread(s): {time.perf_counter() - t:.1f} s", flush=True)
    return out
model_runner.ModelRunner.run = timed
M='/root/.cache/prefixserve/models/SmolLM2-135M-Instruct'
t=time.perf_counter()
engine = build_engine(EngineConfig(model=M, dtype="auto", kv_cache_memory_bytes=1 << 28, num_threads=1, num_prefill_threads=2))
print("build", round(time.perf_counter()-t,1), "runner", round(engine.runner.startup_seconds, 1))
