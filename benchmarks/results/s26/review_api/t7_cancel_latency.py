"""N concurrent long requests (half streamed, half not); all clients disconnect at t=1s; poll the replica's
running+waiting count to see how quickly the server notices and frees them."""
import sys, time, asyncio; sys.path.insert(0,"/tmp/review_api")
from h import *
def counts():
    t=httpx.get(B+"/metrics",headers={"Authorization":"Bearer met-test"}).text
    v={}
    for l in t.splitlines():
        if l.startswith("vllm:num_requests_running") : v["run"]=float(l.split()[-1])
        if l.startswith("vllm:num_requests_waiting") : v["wait"]=float(l.split()[-1])
        if 'state="in_use"' in l: v["in_use"]=float(l.split()[-1])
    return v
async def one(client,i,stream):
    body={"prompt":f"latency {i} "*30,"max_tokens":1500,"ignore_eos":True,"stream":stream}
    async def go():
        if stream:
            async with client.stream("POST",B+"/v1/completions",json=body,headers=H) as r:
                async for _ in r.aiter_bytes(): pass
        else: await client.post(B+"/v1/completions",json=body,headers=H)
    try: await asyncio.wait_for(go(),1.0)
    except asyncio.TimeoutError: pass
async def main(stream):
    async with httpx.AsyncClient(timeout=60,limits=httpx.Limits(max_connections=100)) as c:
        await asyncio.gather(*[one(c,i,stream) for i in range(int(sys.argv[1]))])
for stream in (True, False):
    t0=time.time(); asyncio.run(main(stream)); print("stream" if stream else "non-stream", "all clients gone at", round(time.time()-t0,2))
    for k in range(8):
        time.sleep(1.05); print("  +%ds"%(k+1), counts())
health()
