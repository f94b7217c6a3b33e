import torch, time
torch.set_num_threads(2)
for dt in (torch.bfloat16, torch.float32):
  for n in (1024, 2048):
    a=torch.randn(n,n).to(dt); b=torch.randn(n,n).to(dt)
    for _ in range(3): a@b
    t=time.perf_counter(); 
    for _ in range(10): a@b
    el=(time.perf_counter()-t)/10
    print(dt,n,"%.0f GFLOP/s"%(2*n**3/el/1e9))
