import time, torch
from replica import cpu_kernels
assert cpu_kernels.load()
torch.set_num_threads(1)
for dtype in (torch.float32, torch.bfloat16):
    for M in (1, 2, 3, 12, 16):
        for N, K in ((1024, 512), (8192, 512), (512, 1024), (100, 512)):
            w = torch.randn(N, K).to(dtype); b = torch.randn(N).to(dtype); x = torch.randn(M, K).to(dtype)
            pairs = cpu_kernels.pack_pairs(w)
            ref = cpu_kernels.linear(x, w, b, True, None, 0, pairs, 17)
            cpu_kernels.arm_step_helper(True)
            outs = [cpu_kernels.linear(x, w, b, True, None, 0, pairs, 17) for _ in range(20)]
            cpu_kernels.arm_step_helper(False)
            assert all(torch.equal(o, ref) for o in outs), (dtype, M, N, K)
print("equal; helper chunks", cpu_kernels.step_helper_chunks())
# timing: 12 rows fp32, tiny llama shapes
for dtype in (torch.float32, torch.bfloat16):
    shapes = [(1024,512),(512,512),(2048,512),(512,1024)]*8 + [(8192,512)]
    ws = [torch.randn(n,k).to(dtype) for n,k in shapes]; ps = [cpu_kernels.pack_pairs(w) for w in ws]
    for M in (2, 4, 12):
        xs = {k: torch.randn(M, k).to(dtype) for k in (512, 1024)}
        def step():
            for w, p in zip(ws, ps): cpu_kernels.linear(xs[w.shape[1]], w, None, True, None, 0, p, 17)
        res = {}
        for mode in ("off", "on", "off", "on"):
            best = 1e9
            for _ in range(10):
                if mode == "on": cpu_kernels.arm_step_helper(True)
                t = time.perf_counter(); step(); best = min(best, time.perf_counter() - t)
                if mode == "on": cpu_kernels.arm_step_helper(False)
            res.setdefault(mode, []).append(best * 1e3)
        print(dtype, M, {k: [round(v, 2) for v in vs] for k, vs in res.items()})
