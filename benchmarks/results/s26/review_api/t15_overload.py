"""300 concurrent requests (max_tokens 64): expect 200s and 429s with Retry-After in OpenAI shape, no 500s."""
import sys, asyncio, collections, time; sys.path.insert(0,"/tmp/review_api")
from h import *
async def one(c,i):
    try:
        r=await c.post(B+"/v1/completions",json={"prompt":f"overload {i} "*5,"max_tokens":64,"ignore_eos":True,"stream":i%2==0},headers=H)
        body=r.text
        if r.status_code==200 and i%2==0 and "[DONE]" not in body: return "200-stream-without-DONE"
        if r.status_code==200 and '"error"' in body: return "200-with-error-event:"+body[body.find('"error"'):][:150]
        return f"{r.status_code} retry-after={r.headers.get('retry-after')} {body[:100] if r.status_code!=200 else ''}"
    except Exception as e: return "EXC "+type(e).__name__
async def main():
    async with httpx.AsyncClient(timeout=300,limits=httpx.Limits(max_connections=400)) as c:
        t0=time.time(); res=await asyncio.gather(*[one(c,i) for i in range(300)]); print("%.1fs"%(time.time()-t0))
    for k,v in collections.Counter(res).most_common(): print(v,k)
asyncio.run(main()); health()
