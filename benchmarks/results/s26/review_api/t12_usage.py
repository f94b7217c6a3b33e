"""Usage accounting on repeated long prompts: cold then warm, streamed and not, salts, chat, exact page multiples."""
import sys, json, random; sys.path.insert(0,"/tmp/review_api")
from h import *
import openai
c=openai.OpenAI(base_url=B+"/v1",api_key="sk-test",max_retries=0)
tag=str(random.random())
def u(resp): 
    d=resp.usage.model_dump(); p=d["prompt_tokens_details"]
    return f"prompt={d['prompt_tokens']} compl={d['completion_tokens']} cached={p['cached_tokens']} by_src={p.get('cached_tokens_by_source')} computed={p.get('computed_tokens')} write={p.get('cache_write_tokens')}"
def cmpl(prompt, stream=False, **kw):
    if stream:
        chunks=list(c.completions.create(model=None or "tiny-llama-512x8",prompt=prompt,max_tokens=4,stream=True,stream_options={"include_usage":True},**kw))
        return chunks[-1]
    return c.completions.create(model="tiny-llama-512x8",prompt=prompt,max_tokens=4,**kw)
long="The quick brown fox %s jumps over the lazy dog. "%tag*60
print("cold      ", u(cmpl(long)))
print("warm      ", u(cmpl(long)))
print("warm strm ", u(cmpl(long,stream=True)))
print("salt A    ", u(cmpl(long,extra_body={"cache_salt":"A"})))
print("salt A 2  ", u(cmpl(long,extra_body={"cache_salt":"A"})))
print("extended  ", u(cmpl(long+" and then some more words "*40)))
long2="Another unrelated text %s about streaming. "%tag*60
print("cold strm ", u(cmpl(long2,stream=True)))
print("warm strm ", u(cmpl(long2,stream=True)))
ids=[random.randint(10,8000) for _ in range(256)]
print("256 ids cold", u(cmpl(ids)))
print("256 ids warm", u(cmpl(ids)))
ids2=[random.randint(10,8000) for _ in range(257)]
print("257 ids cold", u(cmpl(ids2)))
print("257 ids warm", u(cmpl(ids2)))
msgs=[{"role":"system","content":"You are a helpful assistant %s. "%tag*40},{"role":"user","content":"hi"}]
for i in range(2):
    r=c.chat.completions.create(model="tiny-llama-512x8",messages=msgs,max_tokens=3); print("chat %d    "%i, u(r))
chunks=list(c.chat.completions.create(model="tiny-llama-512x8",messages=msgs,max_tokens=3,stream=True,stream_options={"include_usage":True})); print("chat strm ", u(chunks[-1]))
