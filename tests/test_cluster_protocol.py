"""The OpenAI wire format and the ingress metrics, without Ray or HTTP."""

from __future__ import annotations

import json

import pytest

from cluster.metrics import IngressMetrics
from cluster.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Usage,
    chat_messages,
    check_token_ids,
    check_unsupported,
    chunk_body,
    completion_prompt,
    parse_json_body,
    parse_request,
    sampling_params,
    sse,
)
from common.types import CachedTokens, EngineStats, RequestOutput
from common.types import SamplingParams


def completion(**body) -> CompletionRequest:
    return parse_request(CompletionRequest, {"model": "m", "prompt": "x", **body})


def test_sampling_fields_map_onto_sampling_params():
    request = completion(max_tokens=7, temperature=0.5, top_p=0.9, top_k=-1, seed=3, stop="\n",
                         stop_token_ids=[2, 3], ignore_eos=True)
    params = sampling_params(request, prompt_len=10, max_model_len=100, default_max_tokens=16)
    assert params == SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=0, seed=3, stop=("\n",),
                                    stop_token_ids=(2, 3), ignore_eos=True)


def test_default_max_tokens_completion_16_chat_rest_of_context():
    assert sampling_params(completion(), prompt_len=10, max_model_len=100, default_max_tokens=16).max_tokens == 16
    assert sampling_params(completion(), prompt_len=90, max_model_len=100, default_max_tokens=16).max_tokens == 10
    chat = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})
    assert sampling_params(chat, prompt_len=30, max_model_len=100, default_max_tokens=None).max_tokens == 70
    chat = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 50, "max_completion_tokens": 5})
    assert sampling_params(chat, prompt_len=30, max_model_len=100, default_max_tokens=None).max_tokens == 5


@pytest.mark.parametrize(
    ("body", "prompt_len", "param"),
    [
        ({"temperature": -1}, 10, "temperature"),
        ({"top_p": 0}, 10, "top_p"),
        ({"top_k": -2}, 10, "top_k"),
        ({"max_tokens": 0}, 10, "max_tokens"),
        ({"max_tokens": 95}, 10, "max_tokens"),
        ({"stop_token_ids": [-1]}, 10, "stop_token_ids"),
        ({"stop": [""]}, 10, "stop"),
        ({}, 100, "prompt"),
    ],
)
def test_bad_sampling_values_are_400(body, prompt_len, param):
    with pytest.raises(APIError) as error:
        sampling_params(completion(**body), prompt_len=prompt_len, max_model_len=100, default_max_tokens=16)
    assert (error.value.status, error.value.param) == (400, param)


@pytest.mark.parametrize(
    ("raw", "message"),
    [(b"{x", "not valid JSON"), (b"[]", "JSON object"), (b"\xff", "not valid JSON")],
)
def test_malformed_bodies(raw, message):
    with pytest.raises(APIError, match=message):
        parse_json_body(raw)


def test_validation_errors_name_the_field():
    with pytest.raises(APIError) as error:
        parse_request(CompletionRequest, {"model": "m"})
    assert (error.value.param, error.value.message) == ("prompt", "missing required field 'prompt'")
    with pytest.raises(APIError) as error:
        parse_request(CompletionRequest, {"prompt": "x", "stop": [1]})
    assert error.value.param == "stop"


def test_prompts_and_unsupported_fields():
    assert completion_prompt(completion(prompt=[1, 2])) == [1, 2]
    assert completion_prompt(completion(prompt=["only"])) == "only"
    assert completion_prompt(completion(prompt=[[4, 5]])) == [4, 5]
    with pytest.raises(APIError, match="one prompt"):
        completion_prompt(completion(prompt=["a", "b"]))
    with pytest.raises(APIError, match="n=1"):
        check_unsupported(completion(n=2))
    with pytest.raises(APIError, match="logprobs"):
        check_unsupported(completion(logprobs=2))
    with pytest.raises(APIError, match=r"\[0, 10\)"):
        check_token_ids([1, 10], 10)


def test_chat_messages_join_text_parts():
    request = parse_request(ChatCompletionRequest, {"messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]})
    assert chat_messages(request) == [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"}]
    request = parse_request(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(APIError, match="text content"):
        chat_messages(request)


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None}, {"role": "system"}])
def test_chat_messages_refuse_a_message_without_content_unless_the_assistant_s(message):
    request = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}, message]})
    with pytest.raises(APIError, match=r"messages\[1\]\.content is missing"):
        chat_messages(request)
    request = parse_request(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "go"}]})
    assert chat_messages(request)[1] == {"role": "assistant", "content": ""}


def test_usage_reports_cached_tokens_by_source():
    usage = Usage(prompt_tokens=300, completion_tokens=5, cached=CachedTokens(local=128, peer=128),
                  cache_write_tokens=0)
    assert usage.body() == {
        "prompt_tokens": 300, "completion_tokens": 5, "total_tokens": 305,
        "prompt_tokens_details": {"cached_tokens": 256,
                                  "cached_tokens_by_source": {"local": 128, "peer": 128, "host": 0, "disk": 0},
                                  "computed_tokens": 44, "cache_write_tokens": 0},
    }


def test_sse_chunks():
    chunk = chunk_body("chat", "id", "m", 1, "r", role=True, include_usage=True)
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": ""} and chunk["usage"] is None
    final = chunk_body("completion", "id", "m", 1, "r", usage=Usage(3, 1, CachedTokens()))
    assert final["choices"] == [] and final["usage"]["total_tokens"] == 4
    line = sse({"a": 1})
    assert line == 'data: {"a":1}\n\n' and json.loads(line[6:]) == {"a": 1}


def test_metrics_render_replica_stats_and_ingress_observations():
    metrics = IngressMetrics()
    metrics.observe_first_token(0.05)
    metrics.observe_finished(RequestOutput("r1", [1], "x", True, "length", 300, 1, CachedTokens(local=256), "rep-a"))
    stats = EngineStats("rep-a", num_prompt_tokens_queried=300, num_prompt_tokens_hit=256, num_pages_total=10,
                        num_pages_free=7, num_pages_cached=3, num_pages_in_use=0, num_evictions=1, num_preemptions=0,
                        num_running=0, num_waiting=2, num_requests_finished=4, page_size=128)
    text = metrics.render([stats]).decode()
    assert 'prefixserve_prefix_cache_queries_total{replica="rep-a"} 300.0' in text
    assert 'prefixserve_prefix_cache_hits_total{replica="rep-a"} 256.0' in text
    assert 'prefixserve_kv_pages{replica="rep-a",state="free"} 7.0' in text
    assert 'prefixserve_num_requests_waiting{replica="rep-a"} 2.0' in text
    assert 'prefixserve_routing_decisions_total{cache="hit",replica="rep-a"} 1.0' in text
    assert 'prefixserve_cached_prompt_tokens_total{replica="rep-a",source="local"} 256.0' in text
    assert "prefixserve_time_to_first_token_seconds_count 1.0" in text
    # a replica that stops answering drops out of the next scrape
    assert "prefixserve_prefix_cache_queries_total{" not in metrics.render([]).decode()
