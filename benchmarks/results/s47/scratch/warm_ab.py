"""In-process A/B of two builds of replica/csrc/prefill_attention.cpp on the warm TTFT (2048 cached + 64 new) and its
floor (64 alone): this box's speed drifts by 10-20% between runs, so the two builds take turns request by request in
one engine. The tree's build is "new"; OLD.cpp (an older copy of the file) is built as a library of its own with its
ops renamed (prefixserve_ab) and swapped in for "old" turns. Attention per layer is timed around each call.
PYTHONPATH=. .venv/bin/python benchmarks/results/s47/scratch/warm_ab.py OLD.cpp --dtype D [--model-dir DIR]
[--rounds N] [--threads 2] [--march haswell]"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from engine_ttft import engine_config, tokens, ttft  # noqa: E402

from replica import cpu_kernels  # noqa: E402
from replica.engine import build_engine  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("old")
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--rounds", type=int, default=12)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--model-dir", default=None)
parser.add_argument("--march", default=None, help="build both with this -march (e.g. haswell: the AVX2 kernels)")
args = parser.parse_args()
cpu_kernels.load()


def build_renamed(path: str, namespace: str) -> None:
    source = Path(path).read_text()
    for macro in ("TORCH_LIBRARY_FRAGMENT(", "TORCH_LIBRARY_IMPL("):
        source = source.replace(macro + "prefixserve_cpu,", macro + namespace + ",")
    build = Path(tempfile.mkdtemp()) / f"{namespace}.cpp"
    build.write_text(source)
    flags = [f"-march={args.march}" if f == "-march=native" and args.march else f for f in cpu_kernels.CFLAGS]
    load(name=f"{namespace}_{abs(hash(source + str(flags))) % 10**8}", sources=[str(build)], extra_cflags=flags,
         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


build_renamed(args.old, "prefixserve_ab_old")
build_renamed(str(Path(cpu_kernels.__file__).parent / "csrc" / "prefill_attention.cpp"), "prefixserve_ab_new")
ops = {"new": torch.ops.prefixserve_ab_new.prefill_attention_f32, "old": torch.ops.prefixserve_ab_old.prefill_attention_f32}
which = ["new"]
spent: dict[str, list[float]] = {"new": [], "old": []}


def swapped(query, k_cache, v_cache, runs, scale, out, bf16_dot=True):
    start = time.perf_counter()
    ops[which[0]](query, k_cache, v_cache, runs, scale, out, bf16_dot)
    spent[which[0]].append(time.perf_counter() - start)


# the engine's compiled forward calls the op itself: its CPU kernel is replaced by ``swapped``
override = torch.library.Library("prefixserve_cpu", "IMPL")
override.impl("prefill_attention_f32", swapped, "CPU")
torch.set_num_threads(1)
engine = build_engine(engine_config(args.model_dir, args.dtype, args.threads))
prefix = tokens(2048, seed=10)
for name in ("new", "old"):
    which[0] = name
    ttft(engine, tokens(300, seed=999), "warmup")
ttft(engine, prefix + tokens(64, seed=1), "cold")
warm = {"new": [], "old": []}
floor = {"new": [], "old": []}
layer = {"new": [], "old": []}
for r in range(args.rounds):
    for name in (("new", "old") if r % 2 == 0 else ("old", "new")):
        which[0] = name
        spent[name].clear()
        warm[name].append(ttft(engine, prefix + tokens(64, seed=2000 + 2 * r + (name == "old")), f"warm-{r}"))
        layer[name].append(statistics.median(spent[name]))
        floor[name].append(ttft(engine, tokens(64, seed=3000 + 2 * r + (name == "old")), f"floor-{r}"))
for name in ("old", "new"):
    w, f = statistics.median(warm[name]), statistics.median(floor[name])
    print(f"{args.dtype} {name}: median warm {w * 1e3:.1f} ms, floor {f * 1e3:.1f} ms, ratio {w / f:.2f}x; "
          f"attention {statistics.median(layer[name]) * 1e6:.0f} us/layer (median of per-request medians)")
