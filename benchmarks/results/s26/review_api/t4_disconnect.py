import sys, time, socket, json, threading; sys.path.insert(0,"/tmp/review_api")
from h import *
def running():
    time.sleep(1.1)
    t=httpx.get(B+"/metrics",headers={"Authorization":"Bearer met-test"}).text
    out={}
    for l in t.splitlines():
        for k in ("vllm:num_requests_running","vllm:num_requests_waiting",'prefixserve_kv_pages{replica','finished_reason="abort"','finished_reason="length"'):
            if l.startswith(k) or (k in l and not l.startswith("#")):
                out[l.rsplit(" ",1)[0][-60:]]=l.rsplit(" ",1)[1]
    return out
def raw(body, path="/v1/completions"):
    s=socket.create_connection(("127.0.0.1",8311))
    data=json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()+data)
    return s
print("before", running())
long={"prompt":"tell me a story "*20,"max_tokens":1900,"ignore_eos":True}
# 1: streamed, disconnect after first bytes
t0=time.time()
s=raw({**long,"stream":True}); print("first bytes:", s.recv(300)[:80]); s.close()
print("after stream disconnect", running())
# 2: non-streamed, disconnect after 2s
s=raw(long); time.sleep(2); s.close()
print("after nonstream disconnect (t+1s)", running())
time.sleep(3); print("after nonstream disconnect (t+4s)", running())
# 3: RST close (SO_LINGER 0)
import struct
s=raw({**long,"stream":True}); s.recv(200); s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii',1,0)); s.close()
print("after RST stream", running())
# 4: half-close write side, keep reading? client shutdown(SHUT_WR) but still reading
s=raw({**long,"stream":True,"max_tokens":30}); s.shutdown(socket.SHUT_WR); time.sleep(0.5)
data=b""
s.settimeout(30)
try:
    while True:
        d=s.recv(65536)
        if not d: break
        data+=d
except Exception as e: print("recv exc", e)
print("half-close got bytes:", len(data), data[-40:])
health()
print("end", running())
