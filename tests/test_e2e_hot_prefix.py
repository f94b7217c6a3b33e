"""Hot-prefix replication end to end over HTTP with the official openai client, DP=2 on real Ray Serve: a prefix
hammered by concurrent requests on one replica is copied ahead of need to the other replica (no request there asked
for it), and a later request there is served from its own cache ("local") with the reference's greedy output; the
ingress's /metrics count the proactive copy and the hit on its pages."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from test_e2e_cross_replica import AUTH, TARGET, both_replicas, make_client
from test_e2e_http import MODEL, PAGE_SIZE, ROUTING_SETTLE_S, cached_of, code_prompt, deploy, make_config, metric_values

pytestmark = pytest.mark.ray

NAME = "hotcopy"


@pytest.fixture(scope="module")
def http_base(ray_session, serve_http_port, tiny_llama_dir):
    from ray import serve

    # thresholds low enough for a short test: hot after 3 requests in 5 s, a holder with 2 requests is busy
    config = make_config(tiny_llama_dir, enable_dp_cross_replica_prefix_copy=True,
                         enable_hot_prefix_replication=True, hot_prefix_min_requests=3, hot_prefix_busy_requests=2)
    deploy(config, NAME)
    yield f"http://127.0.0.1:{serve_http_port}"
    serve.delete(NAME)


def completion(client, prompt, target, max_tokens=8):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=max_tokens,
                                                      extra_headers={TARGET: target})
    return raw.parse(), raw.headers["x-prefixserve-replica"]


def metrics_of(http_base):
    return httpx.get(f"{http_base}/{NAME}/metrics", headers=AUTH, timeout=30).text


def labelled(values, **labels):
    return sum(v for key, v in values.items() if all(f'{name}="{value}"' in key for name, value in labels.items()))


def reference_text(model_dir, prompt, max_tokens):
    """transformers' float32 greedy continuation of ``prompt`` (the text after it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids = torch.tensor([tokenizer(prompt).input_ids])
    with torch.inference_mode():
        out = model.generate(input_ids, max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)


def test_a_hot_prefix_is_copied_ahead_of_need_and_hit_there(http_base, tiny_llama_dir):
    client = make_client(http_base, NAME)
    holder, other = both_replicas(client, "hot")
    prefix = code_prompt("hot-shared", num_functions=24)
    first, replica = completion(client, prefix + "\n# warm-up\n", holder)
    assert replica == holder and cached_of(first.usage)[0] == 0
    time.sleep(ROUTING_SETTLE_S)

    # hammer the holder: concurrent requests sharing the prefix keep it busy (all pinned there, so the other replica
    # gets the prefix only by a proactive copy)
    def hammer(index):
        return completion(client, prefix + f"\n# question {index}\n", holder, max_tokens=16)[1]

    def num_copies_done():
        return labelled(metric_values(metrics_of(http_base), "prefixserve_hot_prefix_copies_total"), outcome="done")

    deadline = time.monotonic() + 90
    for round_index in range(5):  # one round is enough unless the machine is so fast the holder never looked busy
        with ThreadPoolExecutor(max_workers=4) as pool:
            assert set(pool.map(hammer, range(8 * round_index, 8 * round_index + 8))) == {holder}
        settle = time.monotonic() + 5
        while num_copies_done() < 1 and time.monotonic() < min(settle, deadline):
            time.sleep(0.25)
        if num_copies_done() >= 1:
            break
    assert num_copies_done() >= 1, metrics_of(http_base)
    time.sleep(ROUTING_SETTLE_S)

    prompt = prefix + "\n# a later question\n"
    later, replica = completion(client, prompt, other)
    assert replica == other
    cached, by_source = cached_of(later.usage)
    num_prefix_pages = cached // PAGE_SIZE
    assert num_prefix_pages >= 3
    assert by_source == {"local": cached, "peer": 0, "host": 0, "disk": 0}  # nothing copied on the request's path
    assert later.choices[0].text == reference_text(tiny_llama_dir, prompt, 8)

    metrics = metrics_of(http_base)
    copies = metric_values(metrics, "prefixserve_hot_prefix_copies_total")
    assert labelled(copies, outcome="started") >= 1 and labelled(copies, outcome="failed") == 0
    pages = metric_values(metrics, "prefixserve_hot_prefix_pages_total")
    assert labelled(pages, replica=other, kind="copied") >= num_prefix_pages
    assert labelled(pages, replica=holder, kind="copied") == 0
    assert labelled(metric_values(metrics, "prefixserve_hot_prefix_hit_pages_total"), replica=other) >= num_prefix_pages
    assert labelled(metric_values(metrics, "prefixserve_hot_prefix_hit_requests_total"), replica=other) == 1
    assert labelled(metric_values(metrics, "prefixserve_hot_prefix_prefetches_total"), replica=other, outcome="ok") >= 1
