"""Decode steps of B requests over L-token contexts in process (an engine with 1 decode and 2 prefill threads, DP=1 on
2 cores): the median and best of 30 steps, with the thread rule as it is ("rule": steps whose rows attend 65536+ keys
in all run on 2 OpenMP threads) or with that key rule off ("helper": every step of < 64 rows on one thread with the step
helper armed).
    PYTHONPATH=. .venv/bin/python benchmarks/results/s41/scratch/decode_wide.py DTYPE rule|helper [L] [B,B,...]"""
import random, statistics, sys, time
dtype, mode = sys.argv[1], sys.argv[2]
length = int(sys.argv[3]) if len(sys.argv) > 3 else 1792
batches = [int(b) for b in (sys.argv[4] if len(sys.argv) > 4 else "24,40,56").split(",")]
import replica.engine as engine_module
from common.types import EngineRequest, SamplingParams
from replica.config import EngineConfig
from replica.engine import build_engine
if mode == "helper":
    engine_module.PREFILL_THREADS_MIN_KEYS = 1 << 40
engine = build_engine(EngineConfig(model="benchmarks/.scratch/tiny-llama-512x8", dtype=dtype,
                                   kv_cache_memory_bytes=3 << 30, num_threads=1, num_prefill_threads=2))
rng = random.Random(0)
cells = []
for batch in batches:
    for index in range(batch):
        prompt = [rng.randrange(100, 8000) for _ in range(length)]
        engine.add_request(EngineRequest(f"b{batch}-{index}", prompt,
                                         SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)))
    while any(seq.num_computed_tokens < length for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting)):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(30):
        started = time.perf_counter(); engine.step(); times.append((time.perf_counter() - started) * 1000)
    cells.append(f"batch {batch}: {statistics.median(times):.2f} / {min(times):.2f}")
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(seq.request_id)
    while engine.has_work():
        engine.step()
print(f"{dtype} {mode}, context {length}: median / best ms  " + "  ".join(cells), flush=True)
