"""Decode steps over long contexts in process: B requests of L distinct prompt tokens each, prefilled, then the median
and best of S decode steps; an engine with 1 decode and 2 prefill threads (DP=1 on 2 cores), the step helper on or
off (PREFIXSERVE_STEP_HELPER).
    PYTHONPATH=. .venv/bin/python benchmarks/results/s40/scratch/decode_long.py DTYPE on|off [L]
Session 41 (s41/decode_wide.txt) ran larger batches, and the engine's key rule (steps whose rows attend 65536+ keys
run on 2 OpenMP threads) either kept ("rule") or switched off ("helper": every step of < 64 rows on one thread with
the helper armed):
    PYTHONPATH=. .venv/bin/python benchmarks/results/s40/scratch/decode_long.py DTYPE on L 24,40,56 rule|helper"""
import os, random, statistics, sys, time
dtype, mode = sys.argv[1], sys.argv[2]
length = int(sys.argv[3]) if len(sys.argv) > 3 else 1792
batches = [int(b) for b in sys.argv[4].split(",")] if len(sys.argv) > 4 else [1, 4]
key_rule = sys.argv[5] if len(sys.argv) > 5 else None
os.environ["PREFIXSERVE_STEP_HELPER"] = "1" if mode == "on" else "0"
import torch
import replica.engine as engine_module
from common.types import EngineRequest, SamplingParams
from replica.config import EngineConfig
from replica.engine import build_engine
if key_rule == "helper":
    engine_module.PREFILL_THREADS_MIN_KEYS = 1 << 40
wide = max(batches) > 4  # (session 41's batches of up to 56 distinct 1792-token contexts need 3 GiB of KV)
engine = build_engine(EngineConfig(model="benchmarks/.scratch/tiny-llama-512x8", dtype=dtype,
                                   kv_cache_memory_bytes=(3 if wide else 1) << 30, num_threads=1,
                                   num_prefill_threads=2))
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
    for _ in range(30 if wide else 40):
        started = time.perf_counter(); engine.step(); times.append((time.perf_counter() - started) * 1000)
    cells.append(f"batch {batch}: {statistics.median(times):.2f} / {min(times):.2f}")
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(seq.request_id)
    while engine.has_work():
        engine.step()
label = f"{key_rule}," if key_rule else f"helper {mode},"
print(f"{dtype} {label} context {length}: median / best ms  " + "  ".join(cells), flush=True)
