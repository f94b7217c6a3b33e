import time, torch
from replica import cpu_kernels
assert cpu_kernels.load()
torch.set_num_threads(1)
g = torch.Generator().manual_seed(5)
cases = []
for n, rows in ((70, 2), (2200, 3), (40, 12), (1000, 5)):
    w = torch.randn(n, 64, generator=g); x = torch.randn(rows, 64, generator=g)
    p = cpu_kernels.pack_pairs(w)
    cases.append((x, w, p, cpu_kernels.linear(x, w, None, pairs=p, pairs_below_rows=17)))
bad = 0; t = time.time()
cpu_kernels.arm_step_helper(True)
for i in range(200000):
    x, w, p, ref = cases[i % 4]
    if not torch.equal(cpu_kernels.linear(x, w, None, pairs=p, pairs_below_rows=17), ref): bad += 1
    if i % 50 == 0: cpu_kernels.arm_step_helper(True)
cpu_kernels.arm_step_helper(False)
print("bad", bad, "chunks", cpu_kernels.step_helper_chunks(), round(time.time() - t, 1), "s")
