import torch, time
torch.set_num_threads(2)
L,P,ps,h,d=8,512,128,4,64
for dt in (torch.bfloat16, torch.float32):
    cache=torch.zeros(L,2,P,ps,h,d,dtype=dt)
    pages=[torch.randn(L,2,ps,h,d).to(dt) for _ in range(16)]
    ids=list(range(100,116))
    def a():
        for i,p in zip(ids,pages): cache[:,:,i].copy_(p)
    stacked=torch.stack(pages,2)
    idx=torch.tensor(ids)
    def b():
        cache.index_copy_(2, idx, stacked)
    def c():
        cache[:,:,100:116].copy_(stacked)
    for f,name in ((a,'per-page'),(b,'index_copy 2thr'),(c,'slice copy')):
        for nt in (1,2):
            torch.set_num_threads(nt)
            ts=[]
            for _ in range(30):
                # evict
                t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
            ts.sort(); print(dt, name, nt, "%.2f ms"%(ts[len(ts)//2]*1e3))
