"""Session 36 scratch: AES-GCM decryption alone (no file), 16 pages of the tiny Llama with 2 threads, interleaved:
one-shot into a contiguous tensor, streamed into one contiguous buffer, streamed into the runs of a pool page (landing
pages), one-shot then the copy into the pool (before). Medians of 40 rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/results/s36/scratch/decrypt_runs.py
"""
import os, time, statistics, torch
from concurrent.futures import ThreadPoolExecutor
from replica.tiers.seal import TierKey, new_nonce
from replica.landing import writable_bytes
for dtype in (torch.bfloat16, torch.float32):
    L,P,H,D = 8,128,4,64
    pool = torch.zeros(L,2,128,P,H,D,dtype=dtype)
    k=TierKey.generate(); n=new_nonce()
    src=torch.randn(L,2,P,H,D).to(dtype); raw=src.view(-1).view(torch.uint8).numpy().tobytes()
    sealed=bytearray(len(raw)+16); k.seal_into(n, raw, b"ad", sealed)
    outs=[torch.empty(L,2,P,H,D,dtype=dtype) for _ in range(16)]
    ex=ThreadPoolExecutor(2)
    ph={"oneshot contiguous": lambda i: k.open_into(n, sealed, b"ad", writable_bytes(outs[i])),
        "stream contiguous": lambda i: k.open_into(n, sealed, b"ad", [memoryview(writable_bytes(outs[i])).cast("B")]),
        "stream pool runs": lambda i: k.open_into(n, sealed, b"ad", writable_bytes(pool[:, :, 20+i])),
        "oneshot + pool copy": lambda i: (k.open_into(n, sealed, b"ad", writable_bytes(outs[i])), pool[:, :, 40+i].copy_(outs[i]))}
    t={x:[] for x in ph}
    for r in range(40):
        for name in (list(ph) if r%2 else list(ph)[::-1]):
            s=time.perf_counter(); list(ex.map(ph[name], range(16))); t[name].append(time.perf_counter()-s)
    for name,v in t.items(): print(dtype, name, "%.2f ms" % (statistics.median(v)*1e3))
