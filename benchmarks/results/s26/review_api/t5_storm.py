import sys, time, asyncio, random, json; sys.path.insert(0,"/tmp/review_api")
from h import *
def metrics():
    t=httpx.get(B+"/metrics",headers={"Authorization":"Bearer met-test"}).text
    keep=("vllm:num_requests_running","vllm:num_requests_waiting",'state="in_use"','prefixserve_aborted_requests_total','finished_reason="abort"',"prefixserve_inflight","prefixserve_requests_in_flight","rejected_requests_total{")
    return [l for l in t.splitlines() if not l.startswith("#") and any(k in l for k in keep)]
async def one(client, i):
    body={"prompt":f"storm {i} "+"lorem ipsum "*random.randint(1,300),"max_tokens":random.randint(50,800),"ignore_eos":True,"stream":i%2==0}
    if i%3==0: body={"messages":[{"role":"user","content":body["prompt"]}],"max_tokens":body["max_tokens"],"ignore_eos":True,"stream":body["stream"]}
    path="/v1/chat/completions" if i%3==0 else "/v1/completions"
    async def go():
        if body["stream"]:
            async with client.stream("POST",B+path,json=body,headers=H) as r:
                async for _ in r.aiter_bytes(): pass
        else:
            await client.post(B+path,json=body,headers=H)
    try:
        await asyncio.wait_for(go(), timeout=random.uniform(0.05,2.0))
        return "done"
    except asyncio.TimeoutError:
        return "cancelled"
    except Exception as e:
        return type(e).__name__
async def main():
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as client:
        for rnd in range(3):
            res=await asyncio.gather(*[one(client,i) for i in range(80)])
            print("round",rnd,{k:res.count(k) for k in set(res)})
asyncio.run(main())
time.sleep(3)
print("\n".join(metrics()))
health()
