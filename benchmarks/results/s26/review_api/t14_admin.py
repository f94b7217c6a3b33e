import sys, random; sys.path.insert(0,"/tmp/review_api")
from h import *
A={"Authorization":"Bearer adm-test"}
def ap(path, body=None, raw=None):
    r=post(path, body, headers=A, raw=raw); show(path+" "+(str(body)[:70] if body is not None else str(raw)[:70]), r, 350); return r
ids=[random.randint(10,8000) for _ in range(300)]
r=ap("/admin/prefixes/pin", {"prompt":ids,"priority":90,"ttl":"10m"})
pid=r.json().get("prefix_id")
show("list", httpx.get(B+"/admin/prefixes",headers=A), 600)
ap("/admin/prefixes/pin", {"prompt":ids,"priority":101})
ap("/admin/prefixes/pin", {"prompt":ids,"priority":-1})
ap("/admin/prefixes/pin", {"prompt":ids,"ttl":"0s"})
ap("/admin/prefixes/pin", None, raw=json.dumps({"prompt":ids}).encode()[:-1]+b',"ttl":1e400}')
ap("/admin/prefixes/pin", {"prompt":ids,"ttl":"25h"})
ap("/admin/prefixes/pin", {"prompt":ids,"ttl":True})
ap("/admin/prefixes/pin", {"prompt":ids,"bogus":1})
ap("/admin/prefixes/pin", {"prompt":ids,"messages":[{"role":"user","content":"x"}]})
ap("/admin/prefixes/pin", {})
ap("/admin/prefixes/pin", {"prompt":[10**30]*200})
ap("/admin/prefixes/pin", {"prompt":"word "*100000})
ap("/admin/prefixes/pin", {"prompt":[5]*5000})
ap("/admin/prefixes/pin", {"messages":[{"role":"user","content":"hello there "*100}],"warm":False})
ap("/admin/prefixes/pin", {"messages":[{"role":"user","content":[{"type":"image_url"}]}]})
ap("/admin/prefixes/pin", {"prompt":ids,"cache_salt":"s"*5_000_000})
ap("/admin/prefixes/pin", None, raw=b'{"prompt":[' + b"9"*5000 + b']}')
ap("/admin/prefixes/unpin", {"prefix_id":"nope"})
ap("/admin/prefixes/unpin", {"prefix_id":pid})
ap("/admin/prefixes/unpin", {"prefix_id":pid})
ap("/admin/prefixes/unpin", {"prefix_id":5})
ap("/admin/prefixes/unpin", {})
# big pin more than retention budget
ap("/admin/prefixes/pin", {"prompt":[random.randint(10,8000) for _ in range(2040)],"priority":100})
show("list", httpx.get(B+"/admin/prefixes",headers=A), 300)
health()
