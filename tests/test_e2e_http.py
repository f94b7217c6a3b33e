"""End to end over real HTTP: the official ``openai`` client against prefixserve's app on real Ray Serve.

Two data-parallel replicas of a tiny random Llama (page size 128), prompts of a few hundred tokens. Checked: completions
and chat, streamed and not (greedy text identical both ways); requests sharing a prefix stay on one replica and report
cached tokens; different prefixes use both replicas; tenants' salts isolate caches; bad input gets the right 4xx in
OpenAI's error shape and the server keeps serving; a client that goes away frees its replica; /metrics and
/reset_prefix_cache; a second app with prefix caching off reports zero cached tokens.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.ray

openai = pytest.importorskip("openai")

API_KEY = "e2e-secret"
TARGET_REPLICA_HEADER = "x-prefixserve-target-replica"
MODEL = "tiny"
PAGE_SIZE = 128
ROUTING_SETTLE_S = 2.5
"""Long enough for replicas' KV events to reach the router (stats period 0.5 s, plus Serve's broadcast: five
periods, for a loaded CI box)."""


def make_config(model_dir: str, **overrides):
    """The e2e apps' config. Eager unless ``enforce_eager=False``: a compile of the forward costs each replica's start
    10-30 s on a slow CI box, and the compiled path is covered in process for every KV source (tests/
    test_engine_equivalence.py, test_kv_sources.py, ...) and over HTTP by this module's own app (``base_url``)."""
    from cluster.config import ServeConfig

    settings = dict(enforce_eager=True, model=model_dir, devices="cpu", data_parallel_degree=2, page_size=PAGE_SIZE,
                    kv_cache_memory="32MiB", num_cpus_per_replica=0.5, served_model_name=MODEL, max_model_len=2048,
                    max_num_batched_tokens=1024, api_key=API_KEY, enable_disk_cache=False, dtype="float32",
                    redis_timeout=10.0)  # where a test gives a Redis: a stall of a loaded box is not an outage
    settings.update(overrides)
    return ServeConfig(**settings)


def deploy(config, name: str) -> None:
    from ray import serve

    from cluster.app import build_app

    serve.run(build_app(config), name=name, route_prefix=f"/{name}")


@pytest.fixture(scope="module")
def base_url(ray_session, serve_http_port, tiny_llama_dir):
    from ray import serve

    deploy(make_config(tiny_llama_dir, enforce_eager=False), "e2e")  # the default: the compiled forward
    yield f"http://127.0.0.1:{serve_http_port}/e2e"
    serve.delete("e2e")


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as session:
        yield session


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def code_prompt(tag: str, num_functions: int = 24) -> str:
    """A few hundred tokens of Python; ``tag`` makes the very first tokens (page 0) unique."""
    lines = [f"# module {tag}: generated helpers"]
    for index in range(num_functions):
        lines.append(f"def helper_{index}(value):\n    return value * {index} + {len(tag)}\n")
    return "\n".join(lines)


def cached_of(usage) -> tuple[int, dict]:
    details = usage.prompt_tokens_details
    return details.cached_tokens, details.model_extra["cached_tokens_by_source"]


def complete(client, prompt, **kwargs):
    """(completion, replica id from the header)."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, temperature=0,
                                                      **{"max_tokens": 4, **kwargs})
    completion = raw.parse()
    assert raw.headers["x-prefixserve-replica"] == completion.model_extra["replica_id"]
    return completion, raw.headers["x-prefixserve-replica"]


# ---- the API --------------------------------------------------------------------------------------------------------
def test_the_replica_logs_how_long_it_took_to_start(client):
    """Issue 9: the start-up time is reported. Serve's replica log (which `prefixserve serve` prints) says how long
    the replica took to start, and how much of it went to its compiled forward (traced, compiled and warmed up)."""
    import ray

    _, replica_id = complete(client, "# start-up")
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / "serve"
    text = "".join(path.read_text() for path in logs.glob(f"replica_*_PrefixServeReplica_{replica_id}.log"))
    started = re.search(rf"replica {replica_id} started in ([0-9.]+) s, its compiled forward ready in ([0-9.]+) s: "
                        r"model fingerprint \w+, max_model_len \d+, prefix caching on", text)
    assert started, text[-2000:]
    assert 0 <= float(started[2]) <= float(started[1])


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL  # OpenAI's "retrieve model"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("another-model")


def test_completion_streamed_and_not_agree(client, tokenizer):
    prompt = code_prompt("stream-vs-not")
    num_prompt_tokens = len(tokenizer(prompt).input_ids)
    assert 300 <= num_prompt_tokens <= 1000
    completion, _ = complete(client, prompt, max_tokens=12, extra_body={"ignore_eos": True})
    assert completion.usage.prompt_tokens == num_prompt_tokens
    assert completion.usage.completion_tokens == 12
    assert completion.choices[0].finish_reason == "length"

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == completion.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert all(chunk.usage is None for chunk in chunks[:-1])
    cached, by_source = cached_of(usage_chunk.usage)
    assert cached == sum(by_source.values()) and cached % PAGE_SIZE == 0


def test_prompt_as_token_ids(client, tokenizer):
    token_ids = tokenizer(code_prompt("token-ids")).input_ids
    completion, _ = complete(client, token_ids)
    assert completion.usage.prompt_tokens == len(token_ids)
    assert completion.usage.completion_tokens >= 1


def test_chat_streamed_and_not_agree(client):
    messages = [{"role": "system", "content": code_prompt("chat-system")},
                {"role": "user", "content": "Write helper_24."}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=10,
                                                           temperature=0, extra_body={"ignore_eos": True})
    response = raw.parse()
    assert raw.headers["x-prefixserve-replica"] == response.model_extra["replica_id"]
    assert response.choices[0].message.role == "assistant"
    assert response.usage.completion_tokens == 10 and response.usage.prompt_tokens > 300

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == response.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


# ---- prefix caching and routing ----------------------------------------------------------------------------------------
def test_shared_prefix_sticks_to_one_replica_and_hits(client, tokenizer):
    prefix = code_prompt("shared-prefix")
    first, home = complete(client, prefix + "\n# question 0\n")
    assert cached_of(first.usage)[0] == 0
    time.sleep(ROUTING_SETTLE_S)
    min_cached = (len(tokenizer(prefix).input_ids) // PAGE_SIZE - 1) * PAGE_SIZE
    assert min_cached >= 2 * PAGE_SIZE
    for index in range(1, 5):
        completion, replica = complete(client, prefix + f"\n# question {index}\n")
        cached, by_source = cached_of(completion.usage)
        assert replica == home
        assert cached >= min_cached and cached % PAGE_SIZE == 0
        assert by_source == {"local": cached, "peer": 0, "host": 0, "disk": 0}


def test_different_prefixes_use_both_replicas(client):
    """No replica holds these prefixes: the router balances them (in-flight counts, then a rendezvous hash of the
    first page), so both replicas serve some."""
    prompts = [code_prompt(f"spread-{index}", num_functions=12) for index in range(12)]
    with ThreadPoolExecutor(max_workers=3) as pool:
        replicas = set(pool.map(lambda prompt: complete(client, prompt, max_tokens=8)[1], prompts))
    assert len(replicas) == 2


def test_cache_salt_isolates_tenants(client):
    prompt = code_prompt("salted")
    first, _ = complete(client, prompt, extra_body={"cache_salt": "tenant-a"})
    time.sleep(ROUTING_SETTLE_S)
    again, _ = complete(client, prompt, extra_body={"cache_salt": "tenant-a"})
    other, _ = complete(client, prompt, extra_body={"cache_salt": "tenant-b"})
    unsalted, _ = complete(client, prompt)
    assert cached_of(first.usage)[0] == 0
    assert cached_of(again.usage)[0] >= 2 * PAGE_SIZE
    assert cached_of(other.usage)[0] == 0
    assert cached_of(unsalted.usage)[0] == 0


# ---- bad input ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [1]}, 400, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": "word " * 3000}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [5000, 1]}, 400, "prompt"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages"),
    ],
)
def test_bad_requests_get_openai_errors(http, path, body, status, param):
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_wrong_or_missing_api_key_is_401(base_url, headers):
    response = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_openai_client_sees_bad_request_and_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=-3)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="nope", max_retries=0).models.list()
    completion, _ = complete(client, "def ok():")
    assert completion.usage.completion_tokens >= 1


def test_client_going_away_frees_the_replica(client, http):
    stream = client.completions.create(model=MODEL, prompt="def long_running():", max_tokens=1900, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += 1
        if received == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30  # noticing the disconnect, the abort and the metrics cache on a loaded box
    while time.monotonic() < deadline:
        if metric_sum(http.get("/metrics").text, "prefixserve_num_requests_running") == 0:
            break
        time.sleep(0.2)
    assert metric_sum(http.get("/metrics").text, "prefixserve_num_requests_running") == 0


# ---- operations -----------------------------------------------------------------------------------------------------
def metric_values(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of the samples of metric ``name`` in Prometheus text."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", re.MULTILINE)
    return {labels or "": float(value) for labels, value in pattern.findall(text)}


def metric_sum(text: str, name: str) -> float:
    return sum(metric_values(text, name).values())


def test_metrics(http):
    text = http.get("/metrics").text
    hits = metric_values(text, "prefixserve_prefix_cache_hits_total")
    assert len(hits) == 2 and sum(hits.values()) > 0
    assert metric_sum(text, "prefixserve_prefix_cache_queries_total") >= sum(hits.values())
    assert len(metric_values(text, "prefixserve_kv_pages")) == 8  # 2 replicas x total/free/cached/in_use
    assert metric_sum(text, "prefixserve_time_to_first_token_seconds_count") > 0
    decisions = metric_values(text, "prefixserve_routing_decisions_total")
    assert any('cache="hit"' in labels for labels in decisions)
    assert metric_sum(text, "prefixserve_cached_prompt_tokens_total") > 0


def test_router_decisions_by_reason_in_metrics(client, http):
    """The prefix-aware router in the ingress process counts its decisions by replica and reason on /metrics, and a
    repeated prompt is counted as a prefix hit on the replica that served it (the metrics cache lasts 1 s)."""
    prompt = code_prompt("router-decisions")
    complete(client, prompt)
    time.sleep(ROUTING_SETTLE_S)
    _, replica = complete(client, prompt)
    time.sleep(1.1)
    decisions = metric_values(http.get("/metrics").text, "prefixserve_router_decisions_total")
    assert decisions.get(f'{{reason="prefix_hit",replica="{replica}"}}', 0) >= 1
    assert sum(value for labels, value in decisions.items() if 'reason="no_match"' in labels) >= 1
    assert {labels.split('reason="')[1].split('"')[0] for labels in decisions} == {
        "prefix_hit", "cost_away", "balanced_away", "no_match", "session_move"}


def test_reset_prefix_cache_reaches_every_replica(client, http):
    prompt = code_prompt("reset")
    complete(client, prompt)
    time.sleep(ROUTING_SETTLE_S)
    assert cached_of(complete(client, prompt)[0].usage)[0] > 0
    assert httpx.post(f"{http.base_url}reset_prefix_cache").status_code == 401
    response = http.post("/reset_prefix_cache")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "num_replicas": 2, "all_reset": True}
    text = http.get("/metrics").text
    assert metric_sum(text, "prefixserve_kv_pages") > 0
    assert sum(v for k, v in metric_values(text, "prefixserve_kv_pages").items() if 'state="cached"' in k) == 0
    assert cached_of(complete(client, prompt)[0].usage)[0] == 0


def test_requests_take_the_request_lanes_and_outputs_stay_the_same(client, http):
    """Once the ingress has a request lane open to every replica, its requests go to the replica its router chose over
    the lane, not through Serve's handle (counted by path on /metrics); streamed and non-streamed text of a greedy
    request are the same as ever, side by side too."""
    prompts = [code_prompt(f"lane-{index}") for index in range(4)]

    def lane_count() -> float:
        time.sleep(1.1)  # past the ingress's metrics cache
        return metric_values(http.get("/metrics").text, "prefixserve_lane_requests_total").get('{path="lane"}', 0)

    def streamed(prompt):
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)

    for _ in range(3):  # the first requests open the lanes (in the background) and go through the handle
        before = lane_count()
        expected = [complete(client, prompt, max_tokens=8)[0].choices[0].text for prompt in prompts]
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(streamed, prompts)) == expected
        if lane_count() - before >= 6:
            break
    assert lane_count() - before >= 6


def test_streamed_outputs_after_the_first_come_on_output_channels(client, http):
    """With requests running side by side through Serve's handle (here: pinned to a replica, which a request lane
    does not take), the ingress opens an output channel to their replica (a first output that comes while two or more
    are in flight opens it), and the outputs after the first of the requests sent there next come on the channel,
    several requests' outputs per message; streamed text still equals the non-streamed text of the same greedy
    request."""
    prompts = [code_prompt(f"channel-{index}") for index in range(4)]
    replica = complete(client, prompts[0])[1]
    pin = {TARGET_REPLICA_HEADER: replica}
    expected = [complete(client, prompt, max_tokens=16, extra_body={"ignore_eos": True}, extra_headers=pin)[0]
                .choices[0].text for prompt in prompts]

    def streamed(prompt):
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}, extra_headers=pin)
        return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)

    def counts() -> tuple[dict, float]:
        time.sleep(1.1)  # past the ingress's metrics cache
        text = http.get("/metrics").text
        return (metric_values(text, "prefixserve_streamed_outputs_total"),
                metric_sum(text, "prefixserve_output_channel_messages_total"))

    with ThreadPoolExecutor(4) as pool:
        # two rounds of 4 at once: the first opens the channels, the second comes while they are open. Again if a
        # loaded box ran the first round one at a time (no channel opened) or kept the rounds apart longer than a
        # channel stays open idle; each try is counted on its own
        for _ in range(3):
            before, messages_before = counts()
            first_round = list(pool.map(streamed, prompts))
            second_round = list(pool.map(streamed, prompts))
            assert first_round == second_round == expected
            after, messages_after = counts()
            on_channel = after.get('{path="channel"}', 0) - before.get('{path="channel"}', 0)
            if on_channel >= 4 * 15 - 15:
                break
    on_requests = after['{path="request"}'] - before.get('{path="request"}', 0)
    messages = messages_after - messages_before
    assert on_requests >= 8  # each request's first output, on its own stream
    assert on_channel >= 4 * 15 - 15  # the other 15 tokens of the second round's (one may have come before)
    assert 0 < messages < on_channel


def test_health(base_url):
    assert httpx.get(f"{base_url}/health").status_code == 200


def test_caching_off_reports_zero_cached_tokens(ray_session, serve_http_port, tiny_llama_dir):
    from ray import serve

    # this app also runs the other replica transport: Ray actor calls instead of Serve's gRPC (the default)
    deploy(make_config(tiny_llama_dir, data_parallel_degree=1, enable_prefix_caching=False, replica_transport="ray"),
           "e2e-nocache")
    try:
        nocache = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_http_port}/e2e-nocache/v1", api_key=API_KEY,
                                max_retries=0, timeout=60)
        prompt = code_prompt("no-cache")
        for _ in range(2):
            completion, _ = complete(nocache, prompt)
            cached, by_source = cached_of(completion.usage)
            assert cached == 0 and set(by_source.values()) == {0}
        chunks = nocache.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == completion.choices[0].text
    finally:
        serve.delete("e2e-nocache")
