"""Other projects' named prefix-caching workloads (``prefixserve bench --workload ...``) against prefixserve with prefix
caching on and off, side by side in one Ray session, plus a small Mooncake-format trace.

Each workload keeps its published shape (who shares what with whom, pacing) at lengths scaled to this 2-core box
(the scale factors are printed). One random-weight Llama (hidden 256, 4 layers) served twice: app "on" (caching,
DP 2) and app "off" (no caching, DP 2); each workload runs on "off" then "on", so both see the same prompts.

    PYTHONPATH=. .venv/bin/python benchmarks/standard_workloads.py [--out benchmarks/results/standard_workloads.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.config import ClientConfig, LoadConfig  # noqa: E402
from bench.runner import run_benchmark  # noqa: E402
from bench.standard_workloads import make_params  # noqa: E402
from bench.workloads import IdPromptFactory, WorkloadConfig  # noqa: E402

SCALED = {
    # published: 64 groups x 16, 2048 / 128, 256 out
    "generated-shared-prefix": dict(num_groups=4, prompts_per_group=8, system_prompt_len=1024, question_len=64,
                                    output_len=16),
    # published: 10 prefixes, 256 + 256, 128 out (N = --num-prompts)
    "prefix-repetition": dict(prefix_len=256, suffix_len=256, num_prefixes=10, output_len=16),
    # published: 32 groups x 32, 2048 / 256, 256 out
    "shared-prefix-groups": dict(num_groups=4, num_prompts_per_group=8, system_prompt_len=1024, question_len=128,
                                 output_len=16),
    # published: 10 users, 5 rounds, 0.5 qps, 1000 / 2000, 100 out
    "multi-round-qa": dict(num_users=4, num_rounds=4, qps=2.0, shared_system_prompt=500, user_history_prompt=500,
                           answer_len=16, question_len=20),
}


def write_trace(path: Path, num_requests: int = 24, seed: int = 0) -> None:
    """A Mooncake-format trace: conversations whose turns extend the same hash-id chain, 0.2 s apart on average."""
    rng = random.Random(seed)
    rows, now, next_hash = [], 0.0, 0
    chains: list[list[int]] = []
    for _ in range(num_requests):
        if chains and rng.random() < 0.7:
            chain = rng.choice(chains)
            chain.append(next_hash)
            next_hash += 1
        else:
            chain = [next_hash, next_hash + 1]
            next_hash += 2
            chains.append(chain)
        rows.append({"timestamp": int(now), "input_length": 512 * len(chain) - rng.randrange(200),
                     "output_length": 16, "hash_ids": list(chain)})
        now += rng.expovariate(1 / 200)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def deploy(model_dir: str, name: str, caching: bool) -> str:
    from ray import serve

    from cluster.app import build_app
    from cluster.config import ServeConfig

    config = ServeConfig(model=model_dir, devices="cpu", data_parallel_degree=2, page_size=128,
                         kv_cache_memory="64MiB", num_cpus_per_replica=0.5, served_model_name="bench",
                         max_model_len=4096, enable_prefix_caching=caching, enable_disk_cache=False,
                         dtype="float32", enforce_eager=True)
    serve.run(build_app(config), name=name, route_prefix=f"/{name}")
    return name


def run(base_url: str, workload: str, params, concurrency: int) -> dict:
    result = asyncio.run(run_benchmark(ClientConfig(base_url=base_url, model="bench"),
                                       LoadConfig(concurrency=concurrency),
                                       WorkloadConfig(workload=workload, num_requests=40, standard=params),
                                       IdPromptFactory(1024), show_progress=False))
    metrics = result.metrics
    return {"requests": metrics.num_completed, "errors": metrics.num_errors,
            "ttft_p50_ms": metrics.ttft_ms.p50, "ttft_p90_ms": metrics.ttft_ms.p90,
            "cached_token_rate": metrics.cached_token_rate, "duration_s": metrics.duration_s,
            "request_throughput": metrics.request_throughput}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                os.environ.get("PYTHONPATH", "")])
    import ray
    from ray import serve

    from bench.tiny_models import write_tiny_model
    from tests.conftest import find_free_port

    folder = Path(tempfile.mkdtemp(prefix="prefixserve-standard-"))
    write_tiny_model(folder / "model", arch="llama", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                     vocab_size=1024, max_position_embeddings=4096)
    write_trace(folder / "trace.jsonl")
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
    port = find_free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    results = {}
    try:
        for name, caching in (("off", False), ("on", True)):
            deploy(str(folder / "model"), name, caching)
        workloads = {name: make_params(name, params) for name, params in SCALED.items()}
        workloads["mooncake-trace"] = make_params("mooncake-trace", {"trace_file": str(folder / "trace.jsonl")})
        for workload, params in workloads.items():
            for name in ("off", "on"):
                started = time.perf_counter()
                results[f"{workload}/{name}"] = run(f"http://127.0.0.1:{port}/{name}", workload, params,
                                                    args.concurrency)
                print(workload, name, results[f"{workload}/{name}"],
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print("\n| workload | caching | requests | cached prompt tokens | TTFT p50 (ms) | TTFT p90 (ms) | req/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for key, row in results.items():
        workload, name = key.split("/")
        print(f"| {workload} | {name} | {row['requests']} | {row['cached_token_rate']:.0%} | "
              f"{row['ttft_p50_ms']:.0f} | {row['ttft_p90_ms']:.0f} | {row['request_throughput']:.2f} |")
    for workload in workloads:
        off, on = results[f"{workload}/off"], results[f"{workload}/on"]
        print(f"{workload}: TTFT p50 off/on = {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"scaled_params": SCALED, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
