"""Greedy output; pick stop strings from inside it (including ones spanning token boundaries); compare streamed vs
non-streamed text and finish_reason, for completions and chat."""
import sys; sys.path.insert(0,"/tmp/review_api")
from h import *
import openai
c=openai.OpenAI(base_url=B+"/v1",api_key="sk-test",max_retries=0)
M="tiny-llama-512x8"
base=c.completions.create(model=M,prompt="Stop test prompt alpha",max_tokens=40,temperature=0).choices[0].text
print("base", repr(base))
bad=0
for start in range(3, min(len(base)-4, 60), 5):
    stop=base[start:start+3]
    if not stop.strip(): continue
    ns=c.completions.create(model=M,prompt="Stop test prompt alpha",max_tokens=40,temperature=0,stop=[stop]).choices[0]
    chunks=list(c.completions.create(model=M,prompt="Stop test prompt alpha",max_tokens=40,temperature=0,stop=[stop],stream=True))
    st="".join(ch.choices[0].text for ch in chunks if ch.choices); fr=[ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    expect=base[:base.find(stop)]
    ok = ns.text==expect and st==expect and ns.finish_reason=="stop" and fr==["stop"]
    if not ok: bad+=1; print("MISMATCH stop=%r expect=%r nonstream=%r/%s stream=%r/%s"%(stop,expect,ns.text,ns.finish_reason,st,fr))
print("stop mismatches:", bad)
# stop_token_ids: use the token id of a generated token
tok=httpx.post(B+"/v1/completions",json={"prompt":"Stop test prompt alpha","max_tokens":40,"temperature":0},headers=H).json()
r=httpx.post(B+"/v1/completions",json={"prompt":"Stop test prompt alpha","max_tokens":40,"temperature":0,"stop_token_ids":[2]},headers=H).json()
print("stop_token_ids eos", r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"])
