"""4200 slow-body connections (as t10), then: health during, and health + a normal request after the 30 s body
idle timeout; how many of the slow sockets did the server answer with 408 and close?"""
import sys, time, socket, resource; sys.path.insert(0,"/tmp/review_api")
from h import *
resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))
socks=[]
t_start=time.time()
for i in range(4200):
    s=socket.create_connection(("127.0.0.1",8311)); s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":\"")
    socks.append(s)
print("opened in %.1fs" % (time.time()-t_start))
try:
    r=httpx.get(B+"/health",timeout=5); print("health during", r.status_code)
except Exception as e: print("health during EXC", type(e).__name__)
time.sleep(max(0, 40-(time.time()-t_start)))
t0=time.time()
try:
    r=httpx.get(B+"/health",timeout=60); print("health after", r.status_code, "%.2fs"%(time.time()-t0))
except Exception as e: print("health after EXC", type(e).__name__)
r=httpx.post(B+"/v1/completions",json={"prompt":"hi","max_tokens":2},headers=H,timeout=60); print("normal after", r.status_code)
n408=closed=0
for s in socks:
    s.settimeout(0.01)
    try:
        d=s.recv(4096)
        if d.startswith(b"HTTP/1.1 408"): n408+=1
        s.settimeout(0.5)
        if d and s.recv(4096)==b"": closed+=1
    except (socket.timeout, OSError): pass
print("408s", n408, "closed after 408", closed, "of", len(socks))
for s in socks: s.close()
