"""Two concurrent long streamed requests A and B; the client of one of them disconnects after 2 s.
The other must still complete normally. Prints what the survivor received at its end."""
import sys, time, asyncio, json; sys.path.insert(0,"/tmp/review_api")
from h import *
BODY={"prompt":"the survivor test "*10,"max_tokens":600,"ignore_eos":True,"stream":True}
async def reader(client, tag, kill_after=None):
    t0=time.time(); n=0; last=[]
    try:
        async with client.stream("POST",B+"/v1/completions",json=BODY,headers=H) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    n+=1; last=(last+[line])[-2:]
                if kill_after and time.time()-t0>kill_after:
                    return f"{tag}: killed by client after {n} events"
    except Exception as e:
        return f"{tag}: EXC {type(e).__name__} {e}"
    return f"{tag}: finished after {n} events in {time.time()-t0:.1f}s; last={[l[:160] for l in last]}"
async def main(kill_first):
    async with httpx.AsyncClient(timeout=120) as a, httpx.AsyncClient(timeout=120) as b:
        ta=asyncio.create_task(reader(a,"A",2.0 if kill_first else None))
        await asyncio.sleep(0.4)
        tb=asyncio.create_task(reader(b,"B",None if kill_first else 2.0))
        for r in await asyncio.gather(ta,tb): print("  ",r)
if __name__ == "__main__":
  for kill_first in (True, False, True, False):
    print("kill", "A (first)" if kill_first else "B (second)")
    asyncio.run(main(kill_first))
  health()
