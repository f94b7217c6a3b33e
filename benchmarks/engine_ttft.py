"""Engine-level prefix-cache benchmark (one replica, in process, no HTTP).

1. TTFT of a P-token shared prefix + S-token suffix: cold cache, warm cache (prefix cached, new suffix), and the
   suffix alone with no prefix (the physical floor of a cache hit). Rounds are interleaved so noise hits all three.
2. Throughput on unique prompts (nothing to share) with prefix caching on vs off, interleaved rounds.

With ``--compare-prefill-kernel`` every round also times cold, warm and floor with the C++ prefill attention kernel
off (ATen's flash kernel run by run, merged by log-sum-exp), alternating which path goes first.

With ``--peak`` it also says how far warm / floor can fall on this CPU: the attention work the cached prefix adds
(4 x heads x head size x suffix x prefix FLOPs a layer) at the vector units' peak on the prefill threads' cores
(``benchmarks/vector_peak.py``: vdpbf16ps for bfloat16 without AMX, the widest FMA for float32), added to the
measured floor with nothing else counted. Above the 1.5x target, no attention kernel meets it on this CPU.

Usage:
    PYTHONPATH=. .venv/bin/python benchmarks/engine_ttft.py [--prefix-len 2048] [--suffix-len 64] [--rounds 7]
        [--dtype bfloat16] [--compare-prefill-kernel] [--peak]
Prints a markdown table; --json writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from replica import cpu_kernels
from replica import paged_attention
from replica.config import EngineConfig
from replica.engine import build_engine
from replica.model_runner import kv_geometry
from common.types import EngineRequest
from common.types import SamplingParams
from bench.tiny_models import write_tiny_model


def make_model(path: Path) -> Path:
    if not (path / "config.json").exists():
        write_tiny_model(path, arch="llama", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                         vocab_size=8192, seed=0)
    return path


def engine_config(model_dir: str | None, dtype: str, prefill_threads: int, **overrides) -> EngineConfig:
    """The engine these in-process TTFT probes measure: ``model_dir`` (None: the tiny Llama, written to the temp dir
    if missing; "default": the embedded default model), 1 GiB of KV pool, 4096-token steps and contexts."""
    if model_dir is None:
        model_dir = str(Path(tempfile.gettempdir()) / "prefixserve-bench-llama-512x8")
    model = None if model_dir == "default" else str(make_model(Path(model_dir)))
    return EngineConfig(model=model, dtype=dtype, kv_cache_memory_bytes=1 << 30, max_num_batched_tokens=4096,
                        max_model_len=4096, num_prefill_threads=prefill_threads, **overrides)


def prefix_attention_flops(config, prefix_len: int, suffix_len: int) -> float:
    """The attention FLOPs a cached prefix of ``prefix_len`` tokens adds to a prompt of ``suffix_len`` new tokens, over
    every layer: each new token's query heads score the prefix's keys and sum its values (2 x 2 FLOPs a key and head
    dim). The new tokens' attention to each other is the floor's too."""
    geometry = kv_geometry(config)  # layers and head size as the pool's pages have them
    num_heads = (config.get_text_config() if hasattr(config, "get_text_config") else config).num_attention_heads
    return 4.0 * geometry.num_layers * num_heads * geometry.head_dim * suffix_len * prefix_len


def attention_peak_key(dtype: str, flags: set[str], amx: bool) -> str | None:
    """The ``benchmarks/vector_peak.py`` rate the prefill attention kernel's products run on for ``dtype`` on a CPU
    with ``flags``: vdpbf16ps for bfloat16 on AVX512-BF16, else FMAs (bfloat16 is widened to float32 without it); None
    for AMX tiles (not probed) or a CPU without FMA (no vector kernel)."""
    if dtype == "bfloat16" and amx:
        return None
    if dtype == "bfloat16" and "avx512_bf16" in flags:
        return "dpbf16_zmm_per_s"
    if "avx512f" in flags:
        return "fma_zmm_per_s"
    return "fma_ymm_per_s" if "fma" in flags else None


def peak_bound(engine, args, floor_s: float) -> dict | None:
    """The prefix's attention work (FLOPs), the vector peak of ``args.prefill_threads`` cores it runs on (FLOP/s,
    with the probed instruction) and warm / floor if the warm request cost only that work at that peak beyond the
    floor; None where the kernel's instruction is not probed (AMX tiles, or no FMA)."""
    from benchmarks import vector_peak

    key = attention_peak_key(args.dtype, cpu_kernels._cpu_flag_set(), cpu_kernels.has_amx())
    if key is None:
        return None
    rate = vector_peak.measure()[key] * vector_peak.FLOPS_PER_INSTRUCTION[key] * args.prefill_threads
    work = prefix_attention_flops(engine.runner.model.config, args.prefix_len, args.suffix_len)
    return {"instruction": key.removesuffix("_per_s"), "attention_flops": work, "peak_flops_per_s": rate,
            "warm_over_floor_at_peak": (floor_s + work / rate) / floor_s}


def tokens(n: int, seed: int, vocab: int = 8192) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def ttft(engine, prompt: list[int], request_id: str) -> float:
    start = time.perf_counter()
    engine.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    first = None
    while engine.has_work():
        outs = engine.step()
        if outs and first is None:
            first = time.perf_counter() - start
    return first


def run_batch(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[float, int]:
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt,
                                         SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    num_tokens = 0
    while engine.has_work():
        num_tokens += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - start, num_tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "prefixserve-bench-llama-512x8"),
                        help="a model folder (the tiny Llama is written there if it holds none), or 'default': the "
                             "embedded default model (SmolLM2-135M-Instruct)")
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--unique-prompts", type=int, default=16)
    parser.add_argument("--unique-len", type=int, default=512)
    parser.add_argument("--unique-out", type=int, default=16)
    parser.add_argument("--json", default=None)
    parser.add_argument("--compare-prefill-kernel", action="store_true")
    parser.add_argument("--peak", action="store_true",
                        help="also give warm / floor with the prefix's attention at this CPU's vector peak")
    parser.add_argument("--prefill-threads", type=int, default=1,
                        help="threads for steps of prefill size (a DP=1 server on 2 cores uses 2; decode keeps 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    engine = build_engine(engine_config(args.model_dir, args.dtype, args.prefill_threads))
    engine_off = build_engine(engine_config(args.model_dir, args.dtype, args.prefill_threads,
                                            enable_prefix_caching=False))
    # warm-up (first calls pay one-off costs)
    ttft(engine, tokens(300, seed=999), "warmup")
    ttft(engine_off, tokens(300, seed=998), "warmup")

    cold, warm, floor = [], [], []
    flash = {"cold": [], "warm": [], "floor": []}
    for r in range(args.rounds):
        paths = [(True, 0, (cold, warm, floor))]
        if args.compare_prefill_kernel:
            paths.append((False, 500, (flash["cold"], flash["warm"], flash["floor"])))
        for kernel, seed, (cold_s, warm_s, floor_s) in (paths if r % 2 == 0 else paths[::-1]):
            paged_attention._CPU_PREFILL_KERNEL = kernel
            prefix = tokens(args.prefix_len, seed=10 + seed + r)
            cold_s.append(ttft(engine, prefix + tokens(args.suffix_len, seed=1000 + seed + r), f"cold-{kernel}-{r}"))
            warm_s.append(ttft(engine, prefix + tokens(args.suffix_len, seed=2000 + seed + r), f"warm-{kernel}-{r}"))
            floor_s.append(ttft(engine, tokens(args.suffix_len, seed=3000 + seed + r), f"floor-{kernel}-{r}"))
    paged_attention._CPU_PREFILL_KERNEL = True

    on_times, off_times = [], []
    for r in range(max(3, args.rounds // 2)):
        prompts = [tokens(args.unique_len, seed=5000 + 100 * r + i) for i in range(args.unique_prompts)]
        pair = [("on", engine, on_times), ("off", engine_off, off_times)]
        for name, eng, sink in (pair if r % 2 == 0 else pair[::-1]):
            elapsed, num_out = run_batch(eng, prompts, args.unique_out, f"{name}-{r}")
            sink.append(args.unique_prompts / elapsed)

    med = statistics.median
    result = {
        "model": args.model_dir, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "dtype": args.dtype,
        "rounds": args.rounds,
        "prefill_threads": args.prefill_threads,
        "ttft_cold_s": cold, "ttft_warm_s": warm, "ttft_floor_s": floor,
        "unique_req_per_s_caching_on": on_times, "unique_req_per_s_caching_off": off_times,
    }
    if args.compare_prefill_kernel:
        result.update({f"ttft_{name}_s_prefill_kernel_off": values for name, values in flash.items()})
    print(f"| metric ({args.prefix_len}-token prefix + {args.suffix_len}-token suffix, {args.dtype}) | median | min |")
    print("|---|---|---|")
    for name, values in (("TTFT cold", cold), ("TTFT warm (prefix cached)", warm), ("TTFT suffix alone (floor)", floor)):
        print(f"| {name} | {med(values) * 1000:.1f} ms | {min(values) * 1000:.1f} ms |")
    print(f"| warm / floor | {med(warm) / med(floor):.2f}x | |")
    if args.peak:
        bound = result["attention_bound"] = peak_bound(engine, args, med(floor))
        if bound is None:
            print("| warm / floor at the vector peak | not probed on this CPU (AMX tiles, or no FMA) | |")
        else:
            print(f"| prefix attention work ({bound['instruction']}, {args.prefill_threads} core(s) at "
                  f"{bound['peak_flops_per_s'] / 1e9:.0f} GFLOP/s) | {bound['attention_flops'] / 1e9:.2f} GFLOP, "
                  f"{bound['attention_flops'] / bound['peak_flops_per_s'] * 1000:.1f} ms at the peak | |")
            print(f"| warm / floor at that peak, nothing else counted (the least any kernel gives) "
                  f"| {bound['warm_over_floor_at_peak']:.2f}x | |")
    if args.compare_prefill_kernel:
        for name, values in flash.items():
            print(f"| TTFT {name}, prefill kernel off (ATen flash run by run) | {med(values) * 1000:.1f} ms "
                  f"| {min(values) * 1000:.1f} ms |")
        print(f"| warm / floor, prefill kernel off | {med(flash['warm']) / med(flash['floor']):.2f}x | |")
    print(f"| cold / warm | {med(cold) / med(warm):.1f}x | |")
    print(f"| unique prompts, caching on (req/s) | {med(on_times):.2f} | |")
    print(f"| unique prompts, caching off (req/s) | {med(off_times):.2f} | |")
    print(f"| on / off throughput | {med(on_times) / med(off_times):.3f} | |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
