"""Where a request with a remote prefix spends its TTFT beyond the local hit's, phase by phase (no Ray).

PYTHONPATH=. .venv/bin/python benchmarks/results/s54/scratch/remote_phases.py [--rounds 9] [--dtype bfloat16]

Engines as kv_sources.py builds them (one torch thread): local hit, disk tier, Redis tier over TCP. Each round stores a
new 2048-token prefix (computed by a writer engine) in both tiers and the local engine, then runs one request
(prefix + 64 new tokens, 1 token out) on each engine in turn. Timestamps come from wrapped methods; each phase is the
time from the previous mark, in ms, medians over the rounds."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from benchmarks import kv_sources as ks  # noqa: E402
from common.types import EngineRequest, SamplingParams  # noqa: E402
from replica import async_engine as ae  # noqa: E402
from replica import engine as eng_mod  # noqa: E402
from replica.async_engine import AsyncEngine  # noqa: E402
from replica.engine import build_engine  # noqa: E402
from replica.kv_sources import PrefixFetcher, build_tiers, page_format_of  # noqa: E402

MARKS: dict[str, float] = {}


def mark(name: str) -> None:
    MARKS.setdefault(name, time.perf_counter())


def wrap(cls, name: str, label: str, is_async: bool = False) -> None:
    original = getattr(cls, name)
    if is_async:
        async def wrapped(self, *a, **k):
            mark(label + ".start")
            try:
                return await original(self, *a, **k)
            finally:
                mark(label + ".end")
    else:
        def wrapped(self, *a, **k):
            mark(label + ".start")
            try:
                return original(self, *a, **k)
            finally:
                mark(label + ".end")
    setattr(cls, name, wrapped)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ks.ensure_model()
    cfg_args = argparse.Namespace(model_dir=None, dtype=args.dtype, kv_cache_mib=256)
    server = ks.private_redis("1gb")
    time.sleep(0.5)
    wrap(AsyncEngine, "_admit", "admit")
    wrap(PrefixFetcher, "fetch", "fetch", is_async=True)
    wrap(eng_mod.LLMEngine, "add", "add")
    wrap(eng_mod.LLMEngine, "_import_pages", "import")
    original_step = eng_mod.LLMEngine._step

    def step(self):
        started = time.perf_counter()
        out = original_step(self)
        if out and "step.end" not in MARKS:
            MARKS["step.start"] = started
            MARKS["step.end"] = time.perf_counter()
        return out

    eng_mod.LLMEngine._step = step
    try:
        writer = build_engine(ks.engine_config(cfg_args, "writer"))
        fmt = page_format_of(writer)
        host, disk = build_tiers(fmt, redis_url=f"redis://127.0.0.1:{server.port}/0", disk_cache_dir=server.folder,
                                 disk_budget_bytes=4 << 30)

        def make(rid, tiers):
            engine = build_engine(ks.engine_config(cfg_args, rid))
            own = build_tiers(page_format_of(engine), redis_url=f"redis://127.0.0.1:{server.port}/0" if tiers == "redis"
                              else None, disk_cache_dir=server.folder if tiers == "disk" else None,
                              disk_budget_bytes=4 << 30) if tiers else []
            return AsyncEngine(engine, PrefixFetcher(page_format_of(engine), tiers=own, own_replica_id=rid))

        modes = {"local": make("m0", None), "disk": make("m3", "disk"), "redis": make("m2", "redis")}
        modes["local, after the others"] = modes["local"]
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in modes}

        def ttft(engine: AsyncEngine, prompt, rid):
            async def run():
                MARKS.clear()
                start = time.perf_counter()
                MARKS["t0"] = start
                request = EngineRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))
                async for out in engine.generate(request):
                    MARKS["out"] = time.perf_counter()
                    return dict(MARKS)
            return asyncio.run(run())

        for r in range(args.rounds + 1):
            prefix = ks.tokens(2048, seed=100 + r)
            writer.add_request(EngineRequest(f"w{r}", prefix, SamplingParams(max_tokens=1, temperature=0.0)))
            while writer.has_work():
                writer.step()
            pages = ks.export_pages(writer, writer.page_keys(prefix))
            PrefixFetcher(fmt, tiers=[host, disk]).store(pages)
            host.flush(30)
            disk.flush(30)
            ttft(modes["local"], prefix, f"warm{r}")
            for name, engine in modes.items():
                marks = ttft(engine, prefix + ks.tokens(64, seed=200 + r), f"{name}{r}")
                for tier in engine.fetcher.tiers:
                    tier.flush(30)
                if r:
                    rows[name].append(marks)
        for name, samples in rows.items():
            order = sorted(samples[0], key=samples[0].get)
            print(f"\n{name}: TTFT median {statistics.median(s['out'] - s['t0'] for s in samples) * 1e3:.2f} ms")
            previous = "t0"
            for key in order[1:]:
                values = [(s[key] - s[previous]) * 1e3 for s in samples if key in s and previous in s]
                print(f"  {previous:>14} -> {key:<14} {statistics.median(values):7.2f} ms "
                      f"(min {min(values):.2f}, max {max(values):.2f})")
                previous = key
        for engine in set(modes.values()):
            engine.shutdown()
        host.close()
        disk.close()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
