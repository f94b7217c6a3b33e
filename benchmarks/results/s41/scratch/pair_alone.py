"""One decode step's linear layers of 17-63 rows (tiny Llama 512 x 8 shapes), one thread: the pair kernel alone (no helper:
what runs when the armed helper sleeps or is busy) against oneDNN's packed GEMM. Best of 10, each mode twice, ms.
    PYTHONPATH=. .venv/bin/python benchmarks/results/s41/scratch/pair_alone.py"""
import time, torch
from replica import cpu_kernels
assert cpu_kernels.load()
torch.set_num_threads(1)
shapes = [(1024, 512), (512, 512), (2048, 512), (512, 1024)] * 8 + [(8192, 512)]
for dtype in (torch.bfloat16, torch.float32):
    ws = [torch.randn(n, k).to(dtype) for n, k in shapes]
    ps = [cpu_kernels.pack_pairs(w) for w in ws]
    for M in (17, 24, 32, 48, 63):
        xs = {k: torch.randn(M, k).to(dtype) for k in (512, 1024)}
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, M) for w in ws]
        res = {}
        for mode in ("onednn1", "pair_alone") * 2:
            best = 1e9
            for _ in range(10):
                t = time.perf_counter()
                if mode == "onednn1":
                    for w, p in zip(ws, packed): cpu_kernels.linear(xs[w.shape[1]], w, None, True, p, 1, None, 0)
                else:
                    for w, p in zip(ws, ps): cpu_kernels.linear(xs[w.shape[1]], w, None, True, None, 0, p, 65)
                best = min(best, time.perf_counter() - t)
            res.setdefault(mode, []).append(round(best * 1e3, 2))
        print(str(dtype).split(".")[1], M, res, flush=True)
