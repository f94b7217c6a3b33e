"""Does the KV pool on 2 MiB pages (transparent huge pages) make the prefill kernel faster as in an engine step
(pages scattered over a 16384-slot pool, caches flushed before each call)? The same keys and values in a 4 KiB-page
pool (torch's allocation) and a 2 MiB one (anonymous mmap, MADV_HUGEPAGE before first touch), calls alternating.
PYTHONPATH=. .venv/bin/python benchmarks/results/s49/scratch/thp_probe.py [dtype] [threads] [heads] [kv_heads]"""
import ctypes
import mmap
import statistics
import sys
import time

import torch

from replica import cpu_kernels

dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
heads, kv_heads = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (8, 4)
torch.set_num_threads(threads)
cpu_kernels.load()
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
MADV_HUGEPAGE = 14
keep = []


def huge_like(t: torch.Tensor) -> torch.Tensor:
    nbytes = t.numel() * t.element_size()
    size = nbytes + (4 << 20)
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    keep.append(m)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    start = (base + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    assert libc.madvise(start, size - (start - base) - (2 << 20), MADV_HUGEPAGE) == 0, ctypes.get_errno()
    out = torch.frombuffer(m, dtype=t.dtype, count=t.numel(), offset=start - base).view(t.shape)
    out.copy_(t)
    return out


def anon_huge_kb() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("AnonHugePages"):
            return int(line.split()[1])
    return -1


gen = torch.Generator().manual_seed(0)
slots, dim, context, tokens = 16384, 64, 2048, 64
before = anon_huge_kb()
small = [torch.randn(slots, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
huge = [huge_like(t) for t in small]
pool_mib = small[0].numel() * small[0].element_size() >> 20
print(f"AnonHugePages {before} -> {anon_huge_kb()} kB; pool {pool_mib} MiB each")
order = torch.randperm(slots // 128, generator=gen).tolist()
runs = torch.tensor([[page * 128, min(128, context + tokens - 128 * i)]
                     for i, page in enumerate(order[:-(-(context + tokens) // 128)])])
query = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
outs = {name: torch.empty_like(query) for name in ("4k", "2m")}
pools = {"4k": small, "2m": huge}
flush = torch.empty(32 << 20)
times = {"4k": [], "2m": []}
for rep in range(63):
    for name in (("4k", "2m") if rep % 2 else ("2m", "4k")):
        flush.fill_(rep)
        start = time.perf_counter()
        torch.ops.prefixserve_cpu.prefill_attention_f32(query, pools[name][0], pools[name][1], runs, dim ** -0.5,
                                                        outs[name])
        if rep >= 3:
            times[name].append(time.perf_counter() - start)
assert torch.equal(outs["4k"], outs["2m"])
for name in ("4k", "2m"):
    median = statistics.median(times[name])
    print(f"{dtype} threads {threads} heads {heads}/{kv_heads}: {name} pages median {median * 1e6:.0f} us"
          f" (min {min(times[name]) * 1e6:.0f})")
