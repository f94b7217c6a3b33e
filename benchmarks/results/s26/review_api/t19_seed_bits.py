"""Seeds that differ only above bit 31 give identical samples (torch's CPU generator keeps 32 bits of the seed)."""
import sys; sys.path.insert(0,"/tmp/review_api")
from h import *
def gen(seed): return post("/v1/completions",{"prompt":"Seed test","max_tokens":12,"temperature":1.0,"seed":seed}).json()["choices"][0]["text"]
for a,b in [(0,2**32),(1,2**32+1),(7,7+5*2**32),(-1,2**63-1),(0,1)]:
    x,y=gen(a),gen(b); print(f"seed {a} vs {b}: {'SAME' if x==y else 'different'}  {x!r} / {y!r}")
