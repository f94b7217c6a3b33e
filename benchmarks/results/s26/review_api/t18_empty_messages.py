"""200k chat messages with empty content (6 MB, under the body limit; 0 'prompt characters' so the pre-tokenize
character bound does not apply): how long does the ingress's single tokenizer thread spend, and does a normal
request wait behind it?"""
import sys, time, threading; sys.path.insert(0,"/tmp/review_api")
from h import *
body={"messages":[{"role":"user","content":""}]*200000,"max_tokens":2}
res={}
def big():
    t0=time.time(); r=post("/v1/chat/completions",body,timeout=300); res["big"]=(r.status_code, r.text[:200], round(time.time()-t0,1))
th=threading.Thread(target=big); th.start(); time.sleep(1.0)
t0=time.time(); r=post("/v1/completions",{"prompt":"hi","max_tokens":2}); print("normal request during it:", r.status_code, "%.1fs"%(time.time()-t0))
th.join(); print("big:", res["big"])
health()
