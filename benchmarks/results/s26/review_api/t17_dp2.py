"""DP=2, --request-timeout 4: deadline behaviour (non-streamed 504, streamed SSE error + [DONE]), peer usage source
via the admin pin header, and the channel-cancel bug with two replicas."""
import sys, time, random, json; sys.path.insert(0,"/tmp/review_api")
from h import *
A={"Authorization":"Bearer adm-test"}
long={"prompt":"deadline test "*10,"max_tokens":1900,"ignore_eos":True}
t0=time.time(); r=post("/v1/completions",long); print("deadline non-stream:", r.status_code, r.text[:250], "%.1fs"%(time.time()-t0))
t0=time.time(); r=post("/v1/completions",{**long,"stream":True}); print("deadline stream:", r.status_code, r.text[-400:].replace("\n"," "), "%.1fs"%(time.time()-t0))
t0=time.time(); r=post("/v1/chat/completions",{"messages":[{"role":"user","content":"x"}],"max_tokens":1900,"ignore_eos":True,"stream":True}); print("deadline chat stream:", r.status_code, r.text[-300:].replace("\n"," "), "%.1fs"%(time.time()-t0))
# peer copy: find the two replica ids
ids=[random.randint(10,8000) for _ in range(700)]
r1=post("/v1/completions",{"prompt":ids,"max_tokens":1},headers=A); rep1=r1.headers.get("x-prefixserve-replica"); print("cold on", rep1, r1.json()["usage"]["prompt_tokens_details"])
reps=set()
for i in range(12):
    reps.add(post("/v1/completions",{"prompt":[random.randint(10,8000)],"max_tokens":1}).headers.get("x-prefixserve-replica"))
print("replicas seen", reps)
other=[x for x in reps if x!=rep1]
if other:
    time.sleep(1)
    r2=post("/v1/completions",{"prompt":ids,"max_tokens":1},headers={**A,"x-prefixserve-target-replica":other[0]}); print("pinned to", r2.headers.get("x-prefixserve-replica"), r2.json()["usage"]["prompt_tokens_details"])
    r3=post("/v1/completions",{"prompt":ids,"max_tokens":1,"stream":True,"stream_options":{"include_usage":True}},headers={**A,"x-prefixserve-target-replica":other[0]});
    last=[l for l in r3.text.splitlines() if l.startswith("data: {")][-1]; print("again streamed", json.loads(last[6:])["usage"]["prompt_tokens_details"])
health()
