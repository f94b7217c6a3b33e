import sys; sys.path.insert(0,"/tmp/review_api")
from h import *
P="/v1/completions"
cases = [
 ("huge int digits", b'{"prompt":"a","max_tokens":' + b"1"*5000 + b'}'),
 ("huge int digits in n", b'{"prompt":"a","n":' + b"9"*4400 + b'}'),
 ("huge int in unknown field", b'{"prompt":"a","foo":' + b"9"*4400 + b'}'),
 ("NaN temp", b'{"prompt":"a","temperature":NaN}'),
 ("Infinity top_p", b'{"prompt":"a","top_p":Infinity}'),
 ("-Infinity max_tokens", b'{"prompt":"a","max_tokens":-Infinity}'),
 ("NaN seed", b'{"prompt":"a","seed":NaN}'),
 ("deep nest 33", b'{"prompt":"a","x":' + b"["*40 + b"]"*40 + b'}'),
 ("deep nest 100000", b'{"prompt":"a","x":' + b"["*100000 + b"]"*100000 + b'}'),
 ("non utf8", b'{"prompt":"\xff\xfe abc"}'),
 ("lone surrogate", b'{"prompt":"\\ud800"}'),
 ("not json", b'hello'),
 ("json array", b'[1,2]'),
 ("json null", b'null'),
 ("empty body", b''),
 ("utf16", '{"prompt":"a"}'.encode("utf-16")),
 ("bom utf8", b'\xef\xbb\xbf{"prompt":"a","max_tokens":2}'),
 ("dup keys", b'{"prompt":"a","max_tokens":2,"max_tokens":3}'),
 ("null byte", b'{"prompt":"a\\u0000b","max_tokens":2}'),
 ("huge array tokens", json.dumps({"prompt":[5]*1_000_000}).encode()),
 ("huge array stop_token_ids", json.dumps({"prompt":"a","stop_token_ids":[5]*2000}).encode()),
 ("many unknown keys", json.dumps({"prompt":"a","max_tokens":1, **{f"k{i}":i for i in range(200000)}}).encode()),
 ("long stop string", json.dumps({"prompt":"a","max_tokens":20,"stop":["x"*1_000_000]}).encode()),
 ("16 long stop strings", json.dumps({"prompt":"a","max_tokens":20,"stop":["y"*400_000]*16}).encode()),
 ("long cache_salt", json.dumps({"prompt":"a","max_tokens":2,"cache_salt":"s"*5_000_000}).encode()),
 ("long model", json.dumps({"prompt":"a","max_tokens":2,"model":"m"*5_000_000}).encode()),
 ("long user", json.dumps({"prompt":"a","max_tokens":2,"user":"u"*5_000_000}).encode()),
 ("long prompt chars", json.dumps({"prompt":"word "*200000}).encode()),
 ("prompt over ctx", json.dumps({"prompt":"word "*3000}).encode()),
 ("prompt tokens over ctx", json.dumps({"prompt":[5]*2048}).encode()),
 ("prompt tokens at ctx-1", json.dumps({"prompt":[5]*2047, "max_tokens":1}).encode()),
 ("prompt tokens at ctx-1 default max", json.dumps({"prompt":[5]*2040}).encode()),
 ("over body limit", b'{"prompt":"' + b"a"*(9*1024*1024) + b'"}'),
 ("pcr nested", json.dumps({"prompt":"a","prompt_cache_retention":{"priority":{"a":1}}}).encode()),
 ("stream_options list", json.dumps({"prompt":"a","stream_options":[1]}).encode()),
 ("stream_options include_usage str", json.dumps({"prompt":"a","stream":True,"stream_options":{"include_usage":"maybe"}}).encode()),
]
for label, raw in cases:
    try:
        r = post(P, None, raw=raw, timeout=120); show(label, r, 300)
    except Exception as e:
        print("EXC", label, type(e).__name__, e)
health()
chat_cases = [
 ("messages not list", {"messages":"hi"}),
 ("message no role", {"messages":[{"content":"hi"}]}),
 ("message role int", {"messages":[{"role":1,"content":"hi"}]}),
 ("content int", {"messages":[{"role":"user","content":5}]}),
 ("content dict", {"messages":[{"role":"user","content":{"a":1}}]}),
 ("content list of str", {"messages":[{"role":"user","content":["a"]}]}),
 ("part no text", {"messages":[{"role":"user","content":[{"type":"text"}]}]}),
 ("cache_control bad", {"messages":[{"role":"user","content":"hi","cache_control":{"type":"persistent"}}],"max_tokens":2}),
 ("cache_control on part str", {"messages":[{"role":"user","content":[{"type":"text","text":"x","cache_control":"yes"}]}],"max_tokens":2}),
 ("cache_control 5 bps", {"messages":[{"role":"user","content":"hi","cache_control":{"type":"ephemeral"}}]*5,"max_tokens":2}),
 ("cache_control ttl 2h", {"messages":[{"role":"user","content":"hi","cache_control":{"type":"ephemeral","ttl":"2h"}}],"max_tokens":2}),
 ("cache_control ttl 25h", {"messages":[{"role":"user","content":"hi","cache_control":{"type":"ephemeral","ttl":"25h"}}],"max_tokens":2}),
 ("many messages", {"messages":[{"role":"user","content":"x"}]*200000,"max_tokens":2}),
 ("content None user", {"messages":[{"role":"user","content":None}],"max_tokens":2}),
 ("chat max_tokens over ctx", {"messages":[{"role":"user","content":"x"}],"max_completion_tokens":5000}),
 ("chat max_completion_tokens 0", {"messages":[{"role":"user","content":"x"}],"max_completion_tokens":0}),
 ("chat long content", {"messages":[{"role":"user","content":"word "*3000}],"max_tokens":2}),
 ("chat template injection", {"messages":[{"role":"user","content":"{{ raise_exception('x') }}"}],"max_tokens":2}),
 ("chat role jinja", {"messages":[{"role":"{% for x in range(99999999) %}{% endfor %}","content":"x"}],"max_tokens":2}),
]
for label, body in chat_cases:
    try:
        r = post("/v1/chat/completions", body, timeout=120); show(label, r, 300)
    except Exception as e:
        print("EXC", label, type(e).__name__, e)
health()
