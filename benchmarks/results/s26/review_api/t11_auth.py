import sys; sys.path.insert(0,"/tmp/review_api")
import httpx
B="http://127.0.0.1:8311"
keys={"none":None,"client":"sk-test","admin":"adm-test","metrics":"met-test","wrong":"nope"}
routes=[("GET","/v1/models",None),("POST","/v1/completions",{"prompt":"a","max_tokens":1}),
        ("POST","/v1/chat/completions",{"messages":[{"role":"user","content":"a"}],"max_tokens":1}),
        ("GET","/metrics",None),("GET","/admin/prefixes",None),("POST","/admin/prefixes/unpin",{"prefix_id":"00"}),
        ("POST","/admin/prefixes/pin",{"prompt":[5]*10}),
        ("GET","/health",None),("GET","/docs",None),("GET","/openapi.json",None),("GET","/redoc",None),
        ("GET","/v1/completions",None),("POST","/admin/drain?timeout_s=abc",None)]
print("route".ljust(34), *[k.ljust(8) for k in keys])
for m,p,body in routes:
    row=[]
    for k,v in keys.items():
        h={"Authorization":f"Bearer {v}"} if v else {}
        r=httpx.request(m,B+p,json=body,headers=h,timeout=60)
        row.append(str(r.status_code).ljust(8))
    print(f"{m} {p}".ljust(34), *row)
# header variants on /v1/models
for label,h in [("bearer lower",{"authorization":"bearer sk-test"}),("BEARER upper",{"Authorization":"BEARER sk-test"}),
                ("double space",{"Authorization":"Bearer  sk-test"}),("trailing space",{"Authorization":"Bearer sk-test "}),
                ("x-api-key",{"x-api-key":"sk-test"}),("api-key",{"api-key":"sk-test"}),("Basic",{"Authorization":"Basic c2stdGVzdA=="}),
                ("no scheme",{"Authorization":"sk-test"}),("key as query",{}),("tab sep",{"Authorization":"Bearer\tsk-test"}),
                ("unicode key",{"Authorization":"Bearer sk-tést".encode("utf-8")}), ("prefix key",{"Authorization":"Bearer sk-tes"}),]:
    url=B+"/v1/models"+("?api_key=sk-test" if label=="key as query" else "")
    try:
        r=httpx.get(url,headers=h); print(label.ljust(16), r.status_code, r.text[:140])
    except Exception as e: print(label, "EXC", e)
# pin header with client key
r=httpx.post(B+"/v1/completions",json={"prompt":"a","max_tokens":1},headers={"Authorization":"Bearer sk-test","x-prefixserve-target-replica":"zzz"}); print("pin hdr client", r.status_code, r.text[:200])
r=httpx.post(B+"/v1/completions",json={"prompt":"a","max_tokens":1},headers={"Authorization":"Bearer adm-test","x-prefixserve-target-replica":"zzz"}); print("pin hdr admin bogus replica", r.status_code, r.text[:300])
r=httpx.post(B+"/reset_prefix_cache",headers={"Authorization":"Bearer sk-test"}); print("reset client", r.status_code, r.text[:200])
r=httpx.post(B+"/reset_prefix_cache",headers={"Authorization":"Bearer met-test"}); print("reset metrics key", r.status_code, r.text[:200])
r=httpx.get(B+"/reset_prefix_cache",headers={"Authorization":"Bearer sk-test"}); print("reset GET", r.status_code, r.text[:200])
r=httpx.get(B+"/openapi.json"); print("openapi unauth", r.status_code, r.text[:200])
