import torch, time
for nt in (1,2):
    torch.set_num_threads(nt)
    srcs=[torch.randn(4*1024*1024) for _ in range(8)]  # 16 MiB fp32 each
    dsts=[torch.empty(4*1024*1024) for _ in range(8)]
    ts=[]
    for r in range(40):
        i=r%8
        t=time.perf_counter(); dsts[i].copy_(srcs[(i+3)%8]); ts.append(time.perf_counter()-t)
    ts.sort(); print(nt, "16MiB cold copy %.2f ms = %.1f GB/s"%(ts[20]*1e3, 16.78e6/ts[20]/1e9))
