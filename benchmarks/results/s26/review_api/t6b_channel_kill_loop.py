"""Repeat: A (long stream) starts, B (long stream) starts 0.4 s later, A's client disconnects at 2 s; B must finish.
Waits 2 s between rounds so the output channel closes (0.5 s idle) and is re-opened each round. Counts B failures."""
import sys, time, asyncio; sys.path.insert(0,"/tmp/review_api")
from h import *
import t6_channel_kill as t  # reuses reader()
async def rnd():
    async with httpx.AsyncClient(timeout=120) as a, httpx.AsyncClient(timeout=120) as b:
        ta=asyncio.create_task(t.reader(a,"A",2.0)); await asyncio.sleep(0.4)
        tb=asyncio.create_task(t.reader(b,"B",None))
        return await asyncio.gather(ta,tb)
fails=0
for i in range(int(sys.argv[1]) if len(sys.argv)>1 else 6):
    ra, rb = asyncio.run(rnd())
    bad = "OutputChannelClosed" in rb or "EXC" in rb
    fails += bad
    print(i, "B FAILED:" if bad else "B ok", rb[:230])
    time.sleep(2)
print("B failures:", fails)
health()
