import sys, time; sys.path.insert(0,"/tmp/review_api")
from h import *
t0=time.time(); r=post("/v1/chat/completions",{"messages":[{"role":"user","content":""}]*4000,"max_tokens":2}); print(r.status_code, r.text[:250], "%.2fs"%(time.time()-t0))
