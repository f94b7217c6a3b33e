import socket
def raw(req, read=2.0):
    s=socket.create_connection(("127.0.0.1",8311)); s.sendall(req); s.settimeout(read)
    out=b""
    try:
        while True:
            d=s.recv(65536)
            if not d: break
            out+=d
    except socket.timeout: pass
    s.close(); return out
hdr=b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\nContent-Type: application/json\r\n"
body=b'{"prompt":"a","max_tokens":1}'
for label, req in [
 ("CL huge", hdr+b"Content-Length: 99999999999999999999999\r\n\r\n"+body),
 ("CL negative", hdr+b"Content-Length: -5\r\n\r\n"+body),
 ("CL short", hdr+b"Content-Length: 10\r\n\r\n"+body),
 ("chunked 9MB", hdr+b"Transfer-Encoding: chunked\r\n\r\n"+ (b"100000\r\n"+b" "*0x100000+b"\r\n")*9 + b"0\r\n\r\n"),
 ("chunked ok", hdr+b"Transfer-Encoding: chunked\r\n\r\n"+hex(len(body))[2:].encode()+b"\r\n"+body+b"\r\n0\r\n\r\n"),
 ("CL+TE", hdr+b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"+hex(len(body))[2:].encode()+b"\r\n"+body+b"\r\n0\r\n\r\n"),
 ("gzip body", hdr+b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"%len(body)+body),
 ("form ctype", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: %d\r\n\r\n"%len(body)+body),
]:
    out=raw(req)
    first=out.split(b"\r\n",1)[0]; bodyout=out.split(b"\r\n\r\n",1)[-1][:160]
    print(label.ljust(12), first, bodyout)
