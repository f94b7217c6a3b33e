"""Router simulator: the real routing policy and prefix index (router/policy.py, router/index.py) driven by simulated
replicas' KV event streams, against baselines written from their projects' documented rules.

    python -m benchmarks.router_sim compare [--workloads sglang-gsp,llmd-prefix,zipf,multi-turn] [--dp 4,16,64]
                                            [--routers prefixserve,...] [--scale 1.0] [--seed 0] [--out PATH]
    python -m benchmarks.router_sim scale [--replicas 64] [--pages 1000000] [--decisions 20000] [--out PATH]
    python -m benchmarks.router_sim trace FILE.jsonl [--dp 2] [--routers prefixserve,...] [--mode timed|closed]
                                          [--concurrency C] [--cores 2] [--pages 256] [--cost '{"step_ms": ...}']

Modules: costs.py (the calibrated cost model), workloads.py (seeded workloads), replica.py (one simulated replica),
routers.py (ours and the baselines), sim.py (the event loop and metrics), scale.py (decision cost at scale),
trace.py (replaying an exact request sequence, e.g. one recorded from a real run by benchmarks/sim_calibration.py).
Pure Python, no Ray, no torch.
"""
