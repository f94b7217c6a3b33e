import socket, threading, time, sys
sys.path.insert(0, "/work/main")
import uvicorn
from fastapi import FastAPI, Request
from cluster import http_io
from cluster.protocol import APIError
http_io.BODY_IDLE_TIMEOUT_S = 0.5
http_io.BODY_TOTAL_TIMEOUT_S = 1.5
app = FastAPI()
@app.post("/x")
async def x(request: Request):
    try:
        body = await http_io.read_body(request, 1000)
    except APIError as error:
        return http_io.api_error_response(error)
    return {"n": len(body)}
server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=8799, log_level="warning"))
threading.Thread(target=server.run, daemon=True).start()
while not server.started: time.sleep(0.05)
def go(trickle):
    s = socket.create_connection(("127.0.0.1", 8799))
    s.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
    t0 = time.time(); out = b""; s.settimeout(0.2)
    while time.time() - t0 < 5:
        if trickle:
            try: s.sendall(b"a")
            except OSError: pass
        try:
            d = s.recv(4096)
            if not d: print("closed by server after %.2fs" % (time.time() - t0)); break
            out += d
        except socket.timeout: pass
    print(trickle, out[:300])
go(False); go(True)
server.should_exit = True
