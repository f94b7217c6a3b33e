"""4200 connections that send complete headers of a POST /v1/completions and then never finish the body
(Content-Length 1000, 11 bytes sent). Then one normal request and GET /health. Ingress max_ongoing_requests is 4096."""
import sys, time, socket; sys.path.insert(0,"/tmp/review_api")
from h import *
N=int(sys.argv[1]) if len(sys.argv)>1 else 4200
socks=[]
for i in range(N):
    s=socket.create_connection(("127.0.0.1",8311)); s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":\"")
    socks.append(s)
time.sleep(3)
t0=time.time()
try:
    r=httpx.get(B+"/health",timeout=60); print("health", r.status_code, r.text[:200], "%.2fs"%(time.time()-t0))
except Exception as e: print("health EXC", type(e).__name__, e)
t0=time.time()
try:
    r=httpx.post(B+"/v1/completions",json={"prompt":"hi","max_tokens":2},headers=H,timeout=30); print("normal", r.status_code, r.text[:200], "%.2fs"%(time.time()-t0))
except Exception as e: print("normal EXC", type(e).__name__, e, "%.2fs"%(time.time()-t0))
for s in socks: s.close()
time.sleep(3)
print("after close:"); health()
