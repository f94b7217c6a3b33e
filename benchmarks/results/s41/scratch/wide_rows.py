"""Linear layers of one decode step of 16-64 rows (tiny Llama 512 x 8 shapes), in process: oneDNN's packed GEMM on one
thread (the path for 17+ rows before session 41), the pair kernel with the step helper armed (one torch thread), and
oneDNN on two threads. Best of 10 steps, each mode twice, interleaved; also checks the helper's result is bit-equal to
the pair kernel alone. PYTHONPATH=. .venv/bin/python benchmarks/results/s41/scratch/wide_rows.py [rows,...]"""
import sys
import time

import torch

from replica import cpu_kernels

assert cpu_kernels.load()
rows_list = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "16,17,24,32,48,63").split(",")]
shapes = [(1024, 512), (512, 512), (2048, 512), (512, 1024)] * 8 + [(8192, 512)]
for dtype in (torch.bfloat16, torch.float32):
    ws = [torch.randn(n, k).to(dtype) for n, k in shapes]
    ps = [cpu_kernels.pack_pairs(w) for w in ws]
    for M in rows_list:
        xs = {k: torch.randn(M, k).to(dtype) for k in (512, 1024)}
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, M) for w in ws]
        torch.set_num_threads(1)
        x = xs[512]
        alone = cpu_kernels.linear(x, ws[0], None, True, None, 0, ps[0], 65)  # pair kernel, helper not armed
        cpu_kernels.arm_step_helper(True)
        shared = cpu_kernels.linear(x, ws[0], None, True, None, 0, ps[0], 17)
        cpu_kernels.arm_step_helper(False)
        assert torch.equal(alone, shared), (dtype, M)
        ref = torch.nn.functional.linear(x.float(), ws[0].float())
        torch.testing.assert_close(shared.float(), ref, rtol=2e-2, atol=0.25 if dtype == torch.bfloat16 else 1e-3)

        def onednn():
            for w, p in zip(ws, packed):
                cpu_kernels.linear(xs[w.shape[1]], w, None, True, p, 1, None, 0)

        def pairs():
            for w, p in zip(ws, ps):
                cpu_kernels.linear(xs[w.shape[1]], w, None, True, None, 0, p, 17)

        res = {}
        for mode in ("onednn1", "helper", "onednn2") * 2:
            best = 1e9
            for _ in range(10):
                torch.set_num_threads(2 if mode == "onednn2" else 1)
                if mode == "helper":
                    cpu_kernels.arm_step_helper(True)
                t = time.perf_counter()
                (pairs if mode == "helper" else onednn)()
                best = min(best, time.perf_counter() - t)
                if mode == "helper":
                    cpu_kernels.arm_step_helper(False)
            res.setdefault(mode, []).append(round(best * 1e3, 2))
        print(str(dtype).split(".")[1], M, res, flush=True)
torch.set_num_threads(1)
print("helper chunks", cpu_kernels.step_helper_chunks())
