# PYTHONPATH=. .venv/bin/python benchmarks/results/s39/scratch/idle_probe.py bfloat16 75: a 12-token request in process, back to back, then after idle pauses; ms/major faults/minor faults (session 39 probe)
import resource, sys, time, torch
from replica.config import EngineConfig
from replica.engine import build_engine
from common.types import EngineRequest, SamplingParams
dtype = sys.argv[1]; idle = float(sys.argv[2])
eng = build_engine(EngineConfig(model="benchmarks/.scratch/tiny-llama-512x8", dtype=dtype))
n = [0]
def one():
    n[0] += 1
    prompt = [100 + (n[0] * 7 + i) % 8000 for i in range(12)]
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t = time.perf_counter()
    eng.add_request(EngineRequest(f"r{n[0]}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    while eng.has_work():
        eng.step()
    dt = (time.perf_counter() - t) * 1e3
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return dt, r1.ru_majflt - r0.ru_majflt, r1.ru_minflt - r0.ru_minflt
for _ in range(20): one()
print("warm", [f"{x[0]:.2f}/{x[1]}/{x[2]}" for x in (one() for _ in range(5))], flush=True)
for k in range(3):
    time.sleep(idle)
    print(f"after {idle}s idle", [f"{x[0]:.2f}/{x[1]}/{x[2]}" for x in (one() for _ in range(5))], flush=True)
