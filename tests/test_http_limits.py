"""The ingress's HTTP limits and refusals, without Ray: bodies that never finish, fields that would not fit the replica
call, unsupported OpenAI parameters, loose types, and the accounting of requests whose client went away.

The ingress runs here as our class with a fake replica handle (``FakeReplicas``) and hand-built ASGI requests; the
same paths with real Ray Serve are in tests/test_e2e_http.py and tests/test_e2e_faults.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from starlette.requests import Request

from cluster import admin_api, http_io
from cluster.config import ServeConfig
from cluster.openai_api import OpenAIIngress, api
from cluster.protocol import (
    MAX_CACHE_SALT_CHARS,
    MAX_CHAT_MESSAGES,
    MAX_STOP_CHARS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_unsupported,
    parse_json_body,
    parse_request,
)
from common.types import CachedTokens, ReplicaInfo, RequestOutput

INFO = ReplicaInfo("rep-a", "m", "fingerprint", max_model_len=256, page_size=4, enable_prefix_caching=True,
                   vocab_size=1000)


class FakeStream:
    """A replica call: gives ``outputs``, then raises ``error`` or waits as a generation still running does."""

    def __init__(self, outputs: list[RequestOutput], error: BaseException | None = None) -> None:
        self.outputs = list(outputs)
        self.error = error
        self.num_reads = 0
        self.cancelled = False

    def __aiter__(self) -> "FakeStream":
        return self

    async def __anext__(self) -> RequestOutput:
        self.num_reads += 1
        if self.outputs:
            return self.outputs.pop(0)
        if self.error is not None:
            raise self.error
        await asyncio.Event().wait()

    def cancel(self) -> None:
        self.cancelled = True


class FakeReplicas:
    """The replica deployment's handle as the ingress and the admin routes call it."""

    def __init__(self, stream: FakeStream | None = None) -> None:
        self.stream = stream
        self.broadcasts: list[tuple[Any, ...]] = []

    def options(self, **_: Any) -> "FakeReplicas":
        return self

    @property
    def generate(self) -> "FakeReplicas":
        return self

    def remote(self, request: Any) -> FakeStream:
        assert self.stream is not None, "the request reached a replica"
        return self.stream

    def broadcast(self, method: str, *args: Any) -> Any:
        self.broadcasts.append((method, *args))
        results = {"pin_prefix": [{"replica_id": "rep-a", "num_pages_resident": 0, "num_pages_retained": 0}],
                   "unpin_prefix": [True], "take_back_pin": [True]}[method]

        class _Results:
            async def results_async(self, timeout_s: float) -> list[Any]:
                return results

        return _Results()


class NoTokenizer:
    """Fails the test when called: the request should have been refused before tokenizing."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("tokenized")

    apply_chat_template = __call__


def make_ingress(replicas: FakeReplicas | None = None) -> Any:
    """Our ingress class (under Serve's ASGI wrapper), built outside a loop so it starts no warm-up."""
    ingress = OpenAIIngress.__mro__[1](replicas or FakeReplicas(),
                                       ServeConfig(model="m", devices="cpu", output_channels=False))
    ingress._info = INFO
    ingress.tokenizer = NoTokenizer()
    return ingress


def http_request(body: bytes, path: str = "/v1/completions", *, then: str = "end") -> Request:
    """A POST whose body comes in one piece; ``then``: "end" (complete), "stall" (the client stops sending) or
    "trickle" (a byte every 10 ms, never ending)."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": then != "end"}
        if then == "trickle":
            await asyncio.sleep(0.01)
            return {"type": "http.request", "body": b" ", "more_body": True}
        await asyncio.Event().wait()

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": []}
    return Request(scope, receive)


def serve(ingress: Any, body: dict[str, Any] | bytes, kind: str = "completion", **options: Any) -> tuple[int, dict]:
    """The ingress's answer to one request (a test fails after 10 s rather than hang)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = asyncio.run(asyncio.wait_for(ingress._serve_generation(http_request(raw, **options), kind), 10))
    return response.status_code, json.loads(response.body)


def count(ingress: Any, name: str, reason: str) -> float:
    return ingress.metrics.registry.get_sample_value(f"prefixserve_{name}_total", {"reason": reason}) or 0.0


def refusal(model: type, body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as error:
        check_unsupported(parse_request(model, body))
    return error.value


def output(finished: bool = False) -> RequestOutput:
    return RequestOutput("e", [5], "a", finished, "length" if finished else None, 3, 1, CachedTokens(), "rep-a")


# ---- integers Python will not convert --------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [b'{"prompt": "a", "max_tokens": ' + b"1" * 5000 + b"}",
                                 b'{"prompt": "a", "unknown": ' + b"9" * 4400 + b"}",
                                 b'{"prompt": "a", "x": [{"y": -' + b"9" * 4400 + b"}]}"])
def test_an_integer_of_more_than_4300_digits_anywhere_is_400(raw):
    with pytest.raises(APIError, match="not valid JSON") as error:
        parse_json_body(raw)
    assert error.value.status == 400
    ingress = make_ingress()
    status, body = serve(ingress, raw)
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert count(ingress, "rejected_requests", "invalid_request") == 1


# ---- fields that would not fit the replica call ----------------------------------------------------------------------
@pytest.mark.parametrize(("body", "param"), [
    ({"cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)}, "cache_salt"),
    ({"stop": ["y" * 400_000] * 16}, "stop"),
    ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
    ({"stop": ["x" * 2000] * 9}, "stop"),
])
def test_salt_and_stop_strings_are_bounded_before_the_replica_call(body, param):
    status, answer = serve(make_ingress(), {"prompt": [1, 2], **body})  # FakeReplicas fails if the call is made
    assert (status, answer["error"]["param"]) == (400, param)


def test_the_bounds_leave_room_for_real_salts_and_stop_strings():
    request = parse_request(CompletionRequest, {"prompt": "x", "cache_salt": "s" * MAX_CACHE_SALT_CHARS,
                                                "stop": ["y" * (MAX_STOP_CHARS // 16)] * 16})
    assert len(request.cache_salt) == MAX_CACHE_SALT_CHARS


def test_a_replica_call_over_the_grpc_message_limit_is_413():
    error = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, None, None,
                                 details="SERVER: Received message larger than max (6401152 vs. 4194304)")
    ingress = make_ingress(FakeReplicas(FakeStream([], error)))
    status, body = serve(ingress, {"prompt": [1, 2]})
    assert (status, body["error"]["code"]) == (413, "request_too_large") and "larger than max" in body["error"][
        "message"]
    assert count(ingress, "rejected_requests", "request_too_large") == 1


def admin(handler: Any, ingress: Any, body: dict[str, Any]) -> tuple[int, dict]:
    response = asyncio.run(handler(ingress, http_request(json.dumps(body).encode(), "/admin/prefixes")))
    return response.status_code, json.loads(response.body)


def test_an_admin_pin_with_an_overlong_salt_is_400_and_pins_nothing():
    replicas = FakeReplicas()
    status, body = admin(admin_api.pin_prefix, make_ingress(replicas),
                         {"prompt": list(range(10, 30)), "cache_salt": "s" * 5_000_000})
    assert (status, body["error"]["param"], replicas.broadcasts) == (400, "cache_salt", [])


def test_an_admin_pin_whose_warm_up_fails_is_taken_back():
    replicas = FakeReplicas(FakeStream([], RuntimeError("the replica call failed")))
    status, body = admin(admin_api.pin_prefix, make_ingress(replicas), {"prompt": list(range(10, 30))})
    assert status == 500 and "not pinned" in body["error"]["message"]
    (pinned, pin), (taken_back, prefix_id, pin_id) = replicas.broadcasts
    assert (pinned, taken_back) == ("pin_prefix", "take_back_pin") and prefix_id == pin.page_keys[-1].hex()[:32]
    assert pin_id == pin.pin_id and len(pin_id) == 32  # this pin only: a later pin of the prefix stands


# ---- bodies that never finish ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("then", "idle_s", "total_s"), [("stall", 0.1, 60.0), ("trickle", 60.0, 0.3)])
def test_a_body_that_stops_or_trickles_is_408_in_time(monkeypatch, then, idle_s, total_s):
    """Each timeout alone ends its case (``serve`` gives up after 10 s)."""
    monkeypatch.setattr(http_io, "BODY_IDLE_TIMEOUT_S", idle_s)
    monkeypatch.setattr(http_io, "BODY_TOTAL_TIMEOUT_S", total_s)
    ingress = make_ingress()
    status, body = serve(ingress, b'{"prompt": "', then=then)
    assert (status, body["error"]["code"]) == (408, "body_timeout")
    assert count(ingress, "rejected_requests", "body_timeout") == 1 and ingress._num_inflight == 0


def test_a_408_closes_the_connection():
    response = http_io.api_error_response(APIError("slow", status=408, code="body_timeout"))
    assert response.headers["connection"] == "close"


# ---- many chat messages are refused before tokenizing ----------------------------------------------------------------
@pytest.mark.parametrize(("num_messages", "message"), [(200_000, f"at most {MAX_CHAT_MESSAGES} items"),
                                                       (3000, "the messages count as 48000 characters")])
def test_many_empty_chat_messages_are_400_before_tokenizing(num_messages, message):
    body = {"messages": [{"role": "user", "content": ""}] * num_messages, "max_tokens": 2}
    status, answer = serve(make_ingress(), body, "chat", path="/v1/chat/completions")  # NoTokenizer: not tokenized
    assert (status, answer["error"]["param"]) == (400, "messages") and message in answer["error"]["message"]


# ---- unsupported OpenAI parameters -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"logit_bias": {"5": 100}}, "logit_bias"),
    ({"presence_penalty": 2.0}, "presence_penalty"),
    ({"frequency_penalty": -0.5}, "frequency_penalty"),
    ({"logprobs": 0}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_unsupported_parameters_are_refused_naming_them(body, param):
    for model, base in ((CompletionRequest, {"prompt": "x"}),
                        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})):
        error = refusal(model, {**base, **body})
        assert (error.status, error.param) == (400, param) and param in error.message


@pytest.mark.parametrize(("body", "param"), [({"best_of": 3}, "best_of"), ({"suffix": "zzz"}, "suffix")])
def test_completion_only_parameters_are_refused(body, param):
    assert refusal(CompletionRequest, {"prompt": "x", **body}).param == param


def test_the_defaults_clients_send_are_accepted():
    defaults = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
                "parallel_tool_calls": True, "functions": None, "function_call": "none",
                "response_format": {"type": "text"}, "top_logprobs": 0, "logprobs": False, "stream_options": None,
                "some_extension": {"anything": 1}}
    check_unsupported(parse_request(CompletionRequest, {"prompt": "x", "best_of": 1, "suffix": None, **defaults}))
    check_unsupported(parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                            "stream": True, "stream_options": {"include_usage": True},
                                                            **{**defaults, "stream_options": None, "logprobs": None}}))


# ---- strict types ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "param"), [
    ({"stream": "yes"}, "stream"), ({"ignore_eos": "yes"}, "ignore_eos"), ({"echo": 1}, "echo"),
    ({"prompt": [True, False]}, "prompt"), ({"prompt": [[1, True]]}, "prompt"), ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 5.5}, "max_tokens"), ({"max_tokens": "5"}, "max_tokens"), ({"temperature": True}, "temperature"),
    ({"top_p": "0.5"}, "top_p"),
    ({"seed": False}, "seed"), ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
])
def test_json_types_are_strict(body, param):
    with pytest.raises(APIError) as error:
        parse_request(CompletionRequest, {"prompt": "x", **body})
    assert (error.value.status, error.value.param) == (400, param)


def test_an_integer_is_a_float_and_an_integral_float_a_count():
    assert parse_request(CompletionRequest, {"prompt": "x", "temperature": 1}).temperature == 1.0
    parsed = parse_request(CompletionRequest, {"prompt": "x", "max_tokens": 16.0, "top_k": 50.0, "seed": 7.0, "n": 1.0})
    assert (parsed.max_tokens, parsed.top_k, parsed.seed, parsed.n) == (16, 50, 7, 1)
    assert isinstance(parsed.max_tokens, int)


@pytest.mark.parametrize(("body", "param"), [({"ttl": True}, "ttl"), ({"priority": True}, "priority"),
                                             ({"warm": "no"}, "warm"), ({"prompt": [True] * 20}, "prompt")])
def test_admin_pin_types_are_strict(body, param):
    status, answer = admin(admin_api.pin_prefix, make_ingress(), {"prompt": list(range(10, 30)), **body})
    assert (status, answer["error"]["param"]) == (400, param)


# ---- error messages --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "message", "param"), [
    ({"messages": [{"role": "user", "content": "x"}, {"content": "hi"}]}, "missing required field 'messages[1].role'",
     "messages"),
    ({"messages": [{"role": 1, "content": "hi"}]}, "invalid value for 'messages[0].role'", "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "invalid value for 'messages[0].content'", "messages"),
    ({"messages": [{"role": "user"}], "stream_options": {"include_usage": 1}},
     "invalid value for 'stream_options.include_usage'", "stream_options"),
])
def test_validation_errors_name_the_field_by_its_path(body, message, param):
    """The message names the field by its path; ``param`` stays the top-level field."""
    with pytest.raises(APIError) as error:
        parse_request(ChatCompletionRequest, body)
    assert error.value.message.startswith(message) and error.value.param == param


def test_a_union_field_is_named_without_its_member_types():
    with pytest.raises(APIError) as error:
        parse_request(CompletionRequest, {"prompt": [True]})
    assert error.value.message.startswith("invalid value for 'prompt':")
    with pytest.raises(APIError) as error:
        parse_request(CompletionRequest, {"prompt": "x", "stop_token_ids": [1, 2**40]})
    assert error.value.message.startswith("invalid value for 'stop_token_ids[1]':")


def test_unpin_without_a_prefix_names_every_way_to_give_one():
    status, body = admin(admin_api.unpin_prefix, make_ingress(), {})
    assert status == 400 and body["error"]["message"] == "give exactly one of prefix_id, prompt or messages"


# ---- no open API documentation ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"])
def test_no_documentation_routes(path):
    assert TestClient(api).get(path).status_code == 404


# ---- a non-streamed request whose client goes away -------------------------------------------------------------------
@pytest.mark.parametrize(("outputs", "engine"), [([output()], "rep-a"), ([], "unknown")])
def test_a_request_whose_client_goes_away_is_counted_as_aborted(outputs, engine):
    """Serve cancels the handler's task when the client disconnects: after the first output (collecting the rest)
    and before it (waiting for it), the request counts as aborted as a dropped stream does."""
    stream = FakeStream(outputs)
    ingress = make_ingress(FakeReplicas(stream))

    async def main() -> None:
        raw = json.dumps({"prompt": [1, 2, 3], "max_tokens": 50}).encode()
        task = asyncio.create_task(ingress._serve_generation(http_request(raw), "completion"))
        while stream.num_reads < len(outputs) + 1:  # waiting for an output that does not come
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert count(ingress, "aborted_requests", "client_gone") == 1 and ingress._num_inflight == 0
    assert f'engine="{engine}",finished_reason="abort",model_name="m"}} 1.0' in ingress.metrics.render([]).decode()
