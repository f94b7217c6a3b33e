"""The engine the session 49 probes share: ``model_dir`` (None: the tiny Llama) in ``dtype``, steps of prefill size
on ``threads`` threads, warmed up, the probes' 2048-token prefix already cached, and ``rounds`` warm (that prefix + 64
new) and floor (64 alone) requests run before the probe's own."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from engine_ttft import engine_config, tokens, ttft  # noqa: E402,F401  (tokens, ttft: for the probes)

from replica.engine import build_engine  # noqa: E402


def warm_engine(model_dir: str | None, dtype: str, threads: int = 2, rounds: int = 0):
    """(engine, prefix)."""
    torch.set_num_threads(1)
    engine = build_engine(engine_config(model_dir, dtype, threads))
    prefix = tokens(2048, seed=10)
    ttft(engine, tokens(300, seed=999), "warmup")
    ttft(engine, prefix + tokens(64, seed=1), "cold")
    for r in range(rounds):
        ttft(engine, prefix + tokens(64, seed=50 + r), f"w{r}")
        ttft(engine, tokens(64, seed=60 + r), f"f{r}")
    return engine, prefix
