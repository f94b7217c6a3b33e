"""One engine step's forward pass (``ModelRunner.run``) for the tiny Llama 512 x 8 (8 heads / 4 KV heads, vocab 8192):
decode at batch 1 and 4 over ~1024-token contexts, and a fresh 2048-token prefill, per dtype and torch thread count,
for each forward backend side by side in one process (rounds interleave the backends, so machine noise hits them
alike; medians over rounds are reported):

    transformers   the old path: transformers' modeling code, paged attention as its attention function
    eager          the compact model (replica/llama.py), no compilation (what enforce_eager=True runs)
    compiled       the compact model compiled by inductor with the dtype's default options (the default on CPU:
                   freezing for bfloat16, none for float32; replica/compile.py INDUCTOR_OPTIONS)
    freeze         compiled with inductor freezing (weights become constants: oneDNN GEMMs on pre-packed weights)
    nofreeze       compiled without freezing (weights stay graph inputs: aten GEMMs)

    PYTHONPATH=. .venv/bin/python benchmarks/forward_step.py [--threads 1,2] [--dtypes bfloat16,float32]
        [--backends transformers,eager,freeze,nofreeze] [--rounds 7] [--model HF_DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from replica.model_runner import ChunkInput, ModelRunner

try:
    from bench.tiny_models import build_config, build_random_model
except ImportError:  # before the move to bench/
    from replica.tiny_models import build_config, build_random_model

PS = 128
CTX = 1024
PREFILL = 2048
BATCH = 4
BACKENDS = {
    "transformers": dict(backend="transformers"),
    "eager": dict(backend="eager"),
    "compiled": dict(backend="compiled"),  # the default options of the dtype (replica/compile.py INDUCTOR_OPTIONS)
    "freeze": dict(backend="compiled", compile_options={"freezing": True}),
    "nofreeze": dict(backend="compiled", compile_options={"freezing": False}),
}


def load_model(dtype: str, model_dir: str | None):
    if model_dir is not None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    return tiny_llama(dtype)


def tiny_llama(dtype: str):
    config = build_config(arch="llama", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, vocab_size=8192,
                          intermediate_size=None, max_position_embeddings=4096, sliding_window=None, dtype=dtype)
    return build_random_model(config, seed=0, dtype=dtype)


def cpu_line() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "lscpu unavailable"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    model, cpus = fields.get("Model name", "?").strip(), fields.get("CPU(s)", "?").strip()
    return f"{model}, {cpus} CPUs, flags: {' '.join(wanted)}"


class Case:
    """One backend's runner with four 1024-token contexts already in its pages."""

    def __init__(self, model, name: str) -> None:
        pages_per_seq = -(-(CTX + 1) // PS)
        started = time.perf_counter()
        self.runner = ModelRunner(model, num_pages=BATCH * pages_per_seq + PREFILL // PS, page_size=PS,
                                  device=torch.device("cpu"), **BACKENDS[name])
        self.startup = time.perf_counter() - started
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.get_text_config().vocab_size
        self.tables = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(BATCH)]
        for table in self.tables:
            prompt = torch.randint(3, vocab, (CTX,), generator=gen).tolist()
            self.runner.run([ChunkInput(prompt, 0, table, sample=False)])
        self.prefill_tokens = torch.randint(3, vocab, (PREFILL,), generator=gen).tolist()
        self.prefill_table = list(range(BATCH * pages_per_seq, BATCH * pages_per_seq + PREFILL // PS))

    def decode(self, batch: int) -> None:
        self.runner.run([ChunkInput([7 + i], CTX, self.tables[i], sample=True) for i in range(batch)])

    def prefill(self) -> None:
        self.runner.run([ChunkInput(self.prefill_tokens, 0, self.prefill_table, sample=True)])


def per_call(fn, repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat


def measure(threads: int, dtype: str, backends: list[str], rounds: int, model_dir: str | None) -> None:
    torch.set_num_threads(threads)
    model = load_model(dtype, model_dir)
    cases = {name: Case(model, name) for name in backends}
    for case in cases.values():  # first calls of every shape outside the timing
        case.decode(1), case.decode(BATCH), case.prefill()
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for name, case in cases.items():
            times.setdefault((name, "b1"), []).append(per_call(lambda: case.decode(1), 10))
            times.setdefault((name, "b4"), []).append(per_call(lambda: case.decode(BATCH), 10))
            times.setdefault((name, "prefill"), []).append(per_call(case.prefill, 1))
    for name, case in cases.items():
        cells = []
        for what, digits in (("b1", 2), ("b4", 2), ("prefill", 0)):
            values = [t * 1e3 for t in times[(name, what)]]
            cells.append(f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f})")
        print(f"| {dtype} | {threads} | {name} | {' | '.join(cells)} | {case.startup:.1f} | "
              f"{case.runner.num_compiles} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--backends", default="transformers,eager,freeze,nofreeze")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", default=None, help="a local Hugging Face folder instead of the tiny Llama")
    args = parser.parse_args()
    print(f"CPU: {cpu_line()}; torch {torch.__version__}")
    print(f"{args.model or 'tiny Llama 512 x 8'}, ctx {CTX}, page {PS}; medians of {args.rounds} rounds (decode: mean of 10 steps "
          "per round), in parentheses the fastest round; start-up = ModelRunner construction incl. compile (a "
          "runner finding the same model compiled with the same options and threads reuses it)")
    print("| dtype | threads | backend | decode b1 (ms) | decode b4 (ms) | prefill 2048 (ms) | start-up (s) | graphs |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for threads in [int(t) for t in args.threads.split(",")]:
        for dtype in args.dtypes.split(","):
            measure(threads, dtype, args.backends.split(","), args.rounds, args.model)


if __name__ == "__main__":
    main()
