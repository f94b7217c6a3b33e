import httpx, json, sys
B="http://127.0.0.1:8311"
H={"Authorization":"Bearer sk-test"}
def post(path, body, headers=None, raw=None, timeout=60):
    h=dict(H); h.update(headers or {})
    if raw is not None:
        r=httpx.post(B+path, content=raw, headers={**h,"content-type":"application/json"}, timeout=timeout)
    else:
        r=httpx.post(B+path, json=body, headers=h, timeout=timeout)
    return r
def show(label, r, n=400):
    print(f"--- {label}: {r.status_code} {r.text[:n]}")
def health():
    r=httpx.get(B+"/health",timeout=60); ok=httpx.post(B+"/v1/completions",json={"prompt":"hi","max_tokens":2},headers=H,timeout=60)
    print("HEALTH", r.status_code, ok.status_code)
