"""Slow-loris: (a) 200 connections that send headers + Content-Length: 1000 and then a byte every 5 s;
(b) 200 connections that never finish their headers. Meanwhile a normal request must still be served; report whether
the server ever closes the slow connections within 40 s."""
import sys, time, socket, threading; sys.path.insert(0,"/tmp/review_api")
from h import *
body_socks=[]; hdr_socks=[]
for i in range(200):
    s=socket.create_connection(("127.0.0.1",8311)); s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":\"")
    body_socks.append(s)
for i in range(200):
    s=socket.create_connection(("127.0.0.1",8311)); s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"); hdr_socks.append(s)
t0=time.time(); health(); print("normal request while 400 slow connections open took %.2fs"%(time.time()-t0))
def alive(socks, send):
    n=0
    for s in socks:
        try:
            if send: s.sendall(b"a")
            s.setblocking(False)
            try:
                d=s.recv(1000)
                if d==b"": continue  # closed by server
                n+=1  # got a response (e.g. timeout error)
                print("got data:", d[:120]); continue
            except BlockingIOError: n+=1
            finally: s.setblocking(True)
        except OSError: pass
    return n
for k in range(8):
    time.sleep(5)
    print("t=%ds body-slow alive %d, header-slow alive %d"%((k+1)*5, alive(body_socks,True), alive(hdr_socks,False)))
health()
for s in body_socks+hdr_socks: s.close()
