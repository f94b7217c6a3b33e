"""Scratch: random malformed / hostile requests against a running server; every answer must be < 500 and the server
must keep answering a valid request. Usage: http_fuzz.py BASE_URL API_KEY ADMIN_KEY N SEED"""
import json, math, random, sys, time
import httpx
base, key, admin, n, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
rng = random.Random(seed)
WEIRD = [None, True, False, 0, -1, 1, 2**31, 2**63, -2**63, 10**30, 1e308, -1e-308, 0.5, -0.5, 1.5, 3.0, "", "x",
         "1", "NaN", "Infinity", "a" * 5000, "\u0000", "\ud7ff\uffff", "😀" * 10, [], [1], [[1, 2]], [None], {}, {"a": 1},
         [""], ["a"] * 300, {"type": "text", "text": "hi"}, [-5, 3], list(range(3000)), [99999999]]
def weird(): return rng.choice(WEIRD)
def chat_base():
    return {"model": "tiny-llama-512x8", "messages": [{"role": "system", "content": "You are terse."},
                                       {"role": "user", "content": "Say hi"}], "max_tokens": 3, "temperature": 0}
def comp_base():
    return {"model": "tiny-llama-512x8", "prompt": "Hello there", "max_tokens": 3, "temperature": 0}
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options", "logprobs",
          "echo", "prompt", "messages", "model", "user", "presence_penalty", "frequency_penalty", "logit_bias",
          "max_completion_tokens", "best_of", "suffix", "ignore_eos", "cache_salt", "retention", "stop_token_ids",
          "response_format", "tools", "tool_choice", "min_tokens", "prompt_cache_key", "include_stop_str_in_output"]
def mutate(body):
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        f = rng.choice(FIELDS)
        if r < 0.55: body[f] = weird()
        elif r < 0.7: body.pop(rng.choice(list(body) or ["x"]), None)
        elif r < 0.85 and "messages" in body and isinstance(body["messages"], list) and body["messages"]:
            m = rng.choice(body["messages"])
            if isinstance(m, dict):
                k = rng.choice(["role", "content", "cache_control", "name", "tool_calls"])
                m[k] = rng.choice(WEIRD + [[{"type": "text", "text": "x", "cache_control": weird()}],
                                           [{"type": "image_url", "image_url": {"url": "http://x"}}],
                                           {"type": "ephemeral", "ttl": weird()}, "tool", "developer", "assistant"])
        else:
            body["retention"] = {"priority": weird(), "ttl_s": weird(), "num_tokens": weird()}
    return body
paths = [("/v1/completions", comp_base), ("/v1/chat/completions", chat_base)]
bad = 0; codes = {}
hdr = {"authorization": f"Bearer {key}"}
with httpx.Client(base_url=base, timeout=60) as c:
    for i in range(n):
        path, mk = rng.choice(paths)
        body = mutate(mk())
        kind = rng.random()
        try:
            if kind < 0.9:
                content = json.dumps(body, allow_nan=True)
            elif kind < 0.95:
                content = json.dumps(body)[: rng.randint(0, 40)]  # truncated JSON
            else:
                content = json.dumps([body])  # not an object
            r = c.post(path, content=content, headers={**hdr, "content-type": "application/json"})
            code = r.status_code
            if body.get("stream") is True and code == 200:
                text = r.text
                if '"error"' in text and "internal" in text.lower():
                    print("STREAM ERROR", path, content[:300], text[:300], flush=True); bad += 1
        except httpx.HTTPError as e:
            code = type(e).__name__
        codes[code] = codes.get(code, 0) + 1
        if not isinstance(code, int) or code >= 500:
            bad += 1
            print("BAD", code, path, content[:400], (r.text[:300] if isinstance(code, int) else ""), flush=True)
    # admin endpoints with weird bodies and keys
    for i in range(n // 4):
        path = rng.choice(["/admin/prefixes/pin", "/admin/prefixes/unpin", "/reset_prefix_cache", "/admin/drain"][:3])
        k = rng.choice([admin, key, "wrong", "a b"])
        body = rng.choice([{"prompt": weird(), "priority": weird(), "ttl_s": weird()}, {"messages": weird()},
                           {"prefix_id": weird()}, weird()])
        r = c.post(path, content=json.dumps(body), headers={"authorization": f"Bearer {k}", "content-type":
                                                            "application/json"})
        codes[("admin", r.status_code)] = codes.get(("admin", r.status_code), 0) + 1
        if r.status_code >= 500 or (k != admin and r.status_code < 400):
            bad += 1; print("BAD ADMIN", k == admin, r.status_code, path, json.dumps(body)[:200], r.text[:200])
    r = c.post("/v1/completions", json=comp_base(), headers=hdr)
    print("valid after:", r.status_code, r.json()["choices"][0]["text"][:40] if r.status_code == 200 else r.text[:200])
print("codes", codes, "bad", bad)
