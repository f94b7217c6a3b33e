import openai, json, concurrent.futures as cf
c = openai.OpenAI(base_url="http://127.0.0.1:8311/v1", api_key="sk-test", max_retries=0)
M="tiny-llama-512x8"
def tryit(label, f):
    try:
        r=f(); print("OK ", label, (r.model_dump_json()[:500] if hasattr(r,"model_dump_json") else r))
    except Exception as e:
        print("ERR", label, type(e).__name__, str(e)[:300])
# determinism
outs=[c.completions.create(model=M,prompt="Once upon a time",max_tokens=12,temperature=1.0,seed=42).choices[0].text for _ in range(3)]
print("seq same seed:", len(set(outs))==1, outs)
with cf.ThreadPoolExecutor(6) as ex:
    futs=[ex.submit(lambda i: c.completions.create(model=M,prompt="Once upon a time" if i%2==0 else "Other prompt here "*i,max_tokens=12,temperature=1.0,seed=42).choices[0].text, i) for i in range(6)]
    res=[f.result() for f in futs]
print("concurrent same seed:", res[0]==outs[0] and res[2]==outs[0] and res[4]==outs[0], res[0::2])
o2=c.completions.create(model=M,prompt="Once upon a time",max_tokens=12,temperature=1.0,seed=43).choices[0].text
print("diff seed differs:", o2!=outs[0])
g=[c.completions.create(model=M,prompt="Once upon a time",max_tokens=12,temperature=0).choices[0].text for _ in range(2)]
print("greedy same:", g[0]==g[1])
# streaming include_usage
s=c.completions.create(model=M,prompt="Hello",max_tokens=5,stream=True,stream_options={"include_usage":True})
chunks=list(s); print("cmpl stream nchunks", len(chunks)); print(chunks[-2].model_dump_json()); print(chunks[-1].model_dump_json())
s=c.chat.completions.create(model=M,messages=[{"role":"user","content":"Hello"}],max_tokens=5,stream=True,stream_options={"include_usage":True})
chunks=list(s); print("chat stream nchunks", len(chunks)); print(chunks[0].model_dump_json()); print(chunks[-2].model_dump_json()); print(chunks[-1].model_dump_json())
text="".join((ch.choices[0].delta.content or "") for ch in chunks if ch.choices)
print("streamed text", repr(text))
tryit("tools", lambda: c.chat.completions.create(model=M,messages=[{"role":"user","content":"weather?"}],max_tokens=5,tools=[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{}}}}],tool_choice="required"))
tryit("response_format json_schema", lambda: c.chat.completions.create(model=M,messages=[{"role":"user","content":"x"}],max_tokens=5,response_format={"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object"}}}))
tryit("chat logprobs", lambda: c.chat.completions.create(model=M,messages=[{"role":"user","content":"x"}],max_tokens=5,logprobs=True,top_logprobs=2))
tryit("chat top_logprobs only", lambda: c.chat.completions.create(model=M,messages=[{"role":"user","content":"x"}],max_tokens=5,top_logprobs=2))
tryit("chat n=2", lambda: c.chat.completions.create(model=M,messages=[{"role":"user","content":"x"}],max_tokens=5,n=2))
tryit("chat max_completion_tokens", lambda: c.chat.completions.create(model=M,messages=[{"role":"user","content":"x"}],max_completion_tokens=3))
tryit("chat both max", lambda: c.chat.completions.create(model=M,messages=[{"role":"user","content":"x"}],max_completion_tokens=3,max_tokens=7))
tryit("chat image part", lambda: c.chat.completions.create(model=M,messages=[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x/y.png"}}]}],max_tokens=3))
tryit("chat text parts", lambda: c.chat.completions.create(model=M,messages=[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],max_tokens=3))
tryit("chat role bogus", lambda: c.chat.completions.create(model=M,messages=[{"role":"wizard","content":"hi"}],max_tokens=3))
tryit("chat tool msg", lambda: c.chat.completions.create(model=M,messages=[{"role":"user","content":"hi"},{"role":"assistant","content":None,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"1","content":"sunny"}],max_tokens=3))
tryit("chat empty messages", lambda: c.chat.completions.create(model=M,messages=[],max_tokens=3))
tryit("chat stop list", lambda: c.chat.completions.create(model=M,messages=[{"role":"user","content":"hi"}],max_tokens=20,stop=["e","a"]))
tryit("chat parallel_tool_calls", lambda: c.chat.completions.create(model=M,messages=[{"role":"user","content":"hi"}],max_tokens=3,parallel_tool_calls=False))
tryit("chat developer role", lambda: c.chat.completions.create(model=M,messages=[{"role":"developer","content":"be nice"},{"role":"user","content":"hi"}],max_tokens=3))
tryit("embeddings", lambda: c.embeddings.create(model=M,input="hi"))
tryit("models.retrieve", lambda: c.models.retrieve(M))
tryit("models.list", lambda: c.models.list())
