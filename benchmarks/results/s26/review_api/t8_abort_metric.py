"""5 non-streamed requests whose clients disconnect mid-generation, then 5 streamed ones:
how much do prefixserve_aborted_requests_total / vllm:request_success_total{finished_reason="abort"} move?"""
import sys, time, asyncio; sys.path.insert(0,"/tmp/review_api")
from h import *
def aborted():
    t=httpx.get(B+"/metrics",headers={"Authorization":"Bearer met-test"}).text
    return sum(float(l.split()[-1]) for l in t.splitlines() if l.startswith("prefixserve_aborted_requests_total"))
async def one(c, stream):
    body={"prompt":"abort metric "*20,"max_tokens":1500,"ignore_eos":True,"stream":stream}
    async def go():
        if stream:
            async with c.stream("POST",B+"/v1/completions",json=body,headers=H) as r:
                async for _ in r.aiter_bytes(): pass
        else: await c.post(B+"/v1/completions",json=body,headers=H)
    try: await asyncio.wait_for(go(),1.5)
    except asyncio.TimeoutError: pass
async def run(stream):
    async with httpx.AsyncClient(timeout=60) as c:
        for _ in range(5): await one(c, stream)
for stream in (False, True):
    a0=aborted(); asyncio.run(run(stream)); time.sleep(1.5); print("stream" if stream else "non-stream", "5 client disconnects -> aborted +", aborted()-a0)
