"""The OpenAI wire format: request bodies in (validated), response bodies and SSE chunks out. No Ray, no I/O.

Requests are validated with pydantic; anything wrong raises ``APIError`` (status 400 unless said otherwise), which the
ingress turns into the OpenAI error shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Usage in every response (and in the last SSE chunk when ``stream_options.include_usage`` is true)::

    "usage": {"prompt_tokens": 300, "completion_tokens": 8, "total_tokens": 308,
              "prompt_tokens_details": {"cached_tokens": 256,
                                        "cached_tokens_by_source": {"local": 256, "peer": 0, "host": 0, "disk": 0},
                                        "computed_tokens": 44,
                                        "cache_write_tokens": 0}}

``cache_write_tokens``: prompt tokens this request computed and wrote into the prefix cache (whole new pages), like
Anthropic's ``cache_creation_input_tokens``.

Every response body and chunk also carries ``"replica_id"`` (and the ingress sets the ``x-prefixserve-replica`` header).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt,
                      ValidationError, field_validator)

from common.types import CachedTokens, RequestOutput
from common.types import RETENTION_DEFAULT_PRIORITY, Retention, SamplingParams

REPLICA_HEADER = "x-prefixserve-replica"
TARGET_REPLICA_HEADER = "x-prefixserve-target-replica"
"""Request header pinning a request to one replica (its id from REPLICA_HEADER): for operators and tests."""
DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions; chat defaults to the rest of the context."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays / objects a request body may have (OpenAI bodies need about 5)."""
CHARS_PER_TOKEN_BOUND = 16
"""A prompt longer than max_model_len * this many characters is refused before tokenizing: no tokenizer seen packs
more characters than this into one token on ordinary text, so such a prompt could never fit the context anyway."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_CACHE_SALT_CHARS = 1024
"""A salt only has to be unguessable; the bound keeps the replica call (4 MiB gRPC messages) small."""
MAX_STOP_CHARS = 16 * 1024
"""All stop strings of a request together (at most 16 strings, SamplingParams' bound): generous for any real stop
sequence, and far below the 4 MiB gRPC message that carries the request to a replica."""
MAX_CHAT_MESSAGES = 4096
"""Messages per chat request, twice what Azure OpenAI accepts (2048): a bound checked before the messages are built,
so a body of many tiny messages costs little before it is refused (the character bound counts each message too)."""


class APIError(Exception):
    """A request the API refuses; ``status`` is the HTTP status, the rest goes into the OpenAI error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        """Seconds for the ``Retry-After`` header (429 / 503), or None."""

    @property
    def reason(self) -> str:
        """A short label for the rejection metric: the code when there is one, else the status's name."""
        return self.code or _STATUS_REASONS.get(self.status, str(self.status))

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


_STATUS_REASONS = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                   413: "request_too_large", 429: "overloaded", 500: "server_error", 503: "unavailable",
                   504: "timeout"}


def overloaded(message: str, retry_after_s: int = 1) -> APIError:
    """429 in OpenAI's shape, with ``Retry-After``: the server is full now; the same request may succeed later."""
    return APIError(message, status=429, type="rate_limit_error", code="overloaded", retry_after_s=retry_after_s)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---- request models ---------------------------------------------------------------------------------------------------
# Strict types: JSON has real booleans and integers, so "stream": "yes", "ignore_eos": 1 or a prompt [true, false] are
# client bugs to refuse (pydantic's lax mode would read them as true and token ids [1, 0]); an int is a float too.
Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]


def _integral(value: Any) -> Any:
    """An integral float (``16.0``, which vLLM and some clients send for counts) as that int; everything else is left
    to StrictInt (a bool or a string stays an error)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Count = Annotated[StrictInt, BeforeValidator(_integral)]
"""An integer parameter (max_tokens, top_k, seed, n ...): an int, or a float with no fraction."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (unknown fields are ignored, as OpenAI clients send extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Count | None = Field(None, le=INT32_MAX)
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Count | None = Field(None, ge=-1, le=INT32_MAX)
    seed: Count | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    """A 64-bit integer, as torch's generators take (2**70 is a 400, not a 500)."""
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[Annotated[StrictInt, Field(le=INT32_MAX)]] | None = Field(None, max_length=1024)
    ignore_eos: StrictBool = False
    n: Count = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT_CHARS)
    """Isolates a tenant's prefix cache: requests with different salts never share pages."""
    prompt_cache_retention: Union[str, dict[str, Any], None] = None
    """OpenAI's "in_memory" (the default eviction order) | "24h", or prefixserve's {"priority": 0..100, "ttl":
    "5m"|seconds} (``request_retention``)."""
    logprobs: Any = None
    user: str | None = None
    # OpenAI parameters this server does not implement: declared so that ``check_unsupported`` refuses a value that
    # would change the output, instead of ignoring it as an unknown field (their defaults are accepted).
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    top_logprobs: Count | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        total = len(stop) if isinstance(stop, str) else sum(len(item) for item in stop or ())
        if total > MAX_STOP_CHARS:
            raise ValueError(f"the stop strings have {total} characters together; at most {MAX_STOP_CHARS} are "
                             "accepted")
        return stop

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    echo: StrictBool = False
    best_of: Count | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    cache_control: dict[str, Any] | None = None
    """Anthropic-style cache breakpoint after this message: {"type": "ephemeral", "ttl": "5m" | "1h"}."""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_completion_tokens: Count | None = Field(None, le=INT32_MAX)


def parse_json_body(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """The JSON object in ``raw``; APIError(400) for malformed JSON, a non-object, nesting deeper than ``max_depth``,
    a string that is not valid Unicode (a lone surrogate such as ``"\\ud800"``) or an integer of more digits than
    Python converts (4300: json.loads raises a plain ValueError for it, as it does for JSONDecodeError and
    UnicodeDecodeError, its subclasses)."""
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise APIError(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise APIError(f"the request body nests arrays / objects too deeply (at most {max_depth} levels)") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    check_json_value(body, max_depth=max_depth)
    return body


def check_json_value(value: Any, *, max_depth: int = MAX_JSON_DEPTH) -> None:
    """APIError(400) unless ``value`` nests at most ``max_depth`` levels and every string (keys too) encodes as UTF-8.

    Iterative (no recursion on hostile input); each string is encoded once, in C."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, (dict, list)):
            if depth > max_depth:
                raise APIError(f"the request body nests arrays / objects too deeply (at most {max_depth} levels)")
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise APIError(f"the request contains text that is not valid Unicode ({error.reason} at position "
                       f"{error.start}); send UTF-8 text without lone surrogates") from None


def check_prompt_chars(num_chars: int, *, max_chars: int, param: str) -> None:
    """APIError(400) when a prompt has more characters than ``max_chars`` (checked before tokenizing); chat messages
    count CHARS_PER_TOKEN_BOUND characters each besides their text (cluster/openai_api.py's ``prompt_chars``)."""
    if num_chars > max_chars:
        counted = (f"the messages count as {num_chars} characters (their text, and {CHARS_PER_TOKEN_BOUND} for each "
                   "message)" if param == "messages" else f"the prompt has {num_chars} characters")
        raise APIError(f"{counted}; at most {max_chars} are accepted (it could not fit the model's context), so "
                       "shorten the prompt", param=param)


def parse_request(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """Validate ``body`` as ``model``; the first problem becomes an APIError(400) whose message names the field by its
    path (``messages[0].role``) and whose ``param`` is the top-level field."""
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        loc = first.get("loc") or ()
        param = str(loc[0]) if loc else None
        path = _field_path(model, loc) or param
        if first.get("type") == "missing":
            message = f"missing required field {path!r}"
        else:
            message = f"invalid value for {path!r}: {first.get('msg')}"
        raise APIError(message, param=param) from None


def _field_path(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> str:
    """``messages[0].role`` from a pydantic error location: its field names and list indexes, up to the first name
    that is not a field (pydantic names a union's member types, ``list[int]``, in the location; no part of the
    request)."""
    path = ""
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
        elif model is not None and item in model.model_fields:
            path += f".{item}" if path else item
            model = _model_in(model.model_fields[item].annotation)
        else:
            break
    return path


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field's type holds (``list[ChatMessage] | None`` -> ChatMessage), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True), "functions": (None, []), "function_call": (None, "none"),
    "top_logprobs": (None, 0), "best_of": (None, 1), "suffix": (None, ""),
}
"""OpenAI parameters this server does not implement, and the values of each that ask for nothing (clients send these
defaults): any other value is refused rather than silently ignored."""


def check_unsupported(request: _SamplingFields) -> None:
    """APIError(400) naming the first parameter whose value asks for something this server does not do."""
    if request.n != 1:
        raise APIError(f"only n=1 is supported, got n={request.n}", param="n")
    if request.logprobs is not None and request.logprobs is not False:  # 0 too: the chosen token's logprob
        raise APIError("logprobs are not supported", param="logprobs")
    if isinstance(request, CompletionRequest) and request.echo:
        raise APIError("echo is not supported", param="echo")
    for name, defaults in _DEFAULT_ONLY.items():
        value = getattr(request, name, None)  # best_of and suffix: completions only
        if value not in defaults:  # the fields' strict types keep True from equalling 1
            raise APIError(f"{name} is not supported (got {value!r:.100}); leave it out", param=name)
    if request.stream_options is not None and not request.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")


def completion_prompt(request: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: a string or a list of token ids."""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError("only one prompt per request is supported; send one request per prompt", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str) and not prompt:
        raise APIError("the prompt is empty", param="prompt")
    if isinstance(prompt, list) and not prompt:
        raise APIError("the prompt is empty", param="prompt")
    return prompt


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the chat template wants them (text parts joined; other parts refused). Only an assistant message
    may come without content (OpenAI's rule: one that made tool calls); any other is a client bug, refused. Roles go to
    the chat template as given, as vLLM passes them: templates define their own (``ipython``, ``tool`` ...)."""
    messages = []
    for index, message in enumerate(request.messages):
        content = message.content
        if content is None and message.role != "assistant":
            raise APIError(f"messages[{index}].content is missing; only an assistant message may have none",
                           param="messages")
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError("only text content parts are supported", param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        messages.append({"role": message.role, "content": content or ""})
    return messages


# ---- retention (prompt_cache_retention, cache_control) ---------------------------------------------------------------
TTL_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
CACHE_CONTROL_DEFAULT_TTL_S = 300.0
"""Anthropic's default for ``cache_control`` without a ttl (5 minutes)."""


def parse_ttl(value: Any, *, param: str) -> float:
    """A TTL in seconds from a number or a string like "30s", "5m", "1h", "24h"; APIError(400) otherwise."""
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and len(value) <= 16 and value[-1:] in TTL_UNITS:
        try:
            seconds = float(value[:-1]) * TTL_UNITS[value[-1]]
        except ValueError:
            seconds = None
    if seconds is None or not seconds > 0:
        raise APIError(f"invalid ttl {value!r}: give seconds (a positive number) or a string like \"5m\", \"1h\"",
                       param=param)
    return seconds


def _retention(priority: Any, ttl_s: float | None, num_tokens: int | None, param: str) -> Retention:
    try:
        return Retention(priority=priority, ttl_s=ttl_s, num_tokens=num_tokens)
    except ValueError as error:
        raise APIError(str(error), param=param) from None


def request_retention(request: _SamplingFields) -> Retention | None:
    """The retention asked by ``prompt_cache_retention`` for the whole prompt (None: plain LRU, today's behaviour)."""
    value = request.prompt_cache_retention
    param = "prompt_cache_retention"
    if value is None or value in ("in_memory", "in-memory"):
        return None
    if value == "24h":
        return _retention(RETENTION_DEFAULT_PRIORITY, 24 * 3600.0, None, param)
    if not isinstance(value, dict):
        raise APIError(f"prompt_cache_retention must be \"in_memory\", \"24h\" or an object "
                       f"{{\"priority\": 0..100, \"ttl\": \"5m\"}}, got {value!r}", param=param)
    unknown = set(value) - {"priority", "ttl"}
    if unknown:
        raise APIError(f"unknown prompt_cache_retention fields {sorted(unknown)}; use priority and ttl", param=param)
    ttl = value.get("ttl", CACHE_CONTROL_DEFAULT_TTL_S)
    retention = _retention(value.get("priority", RETENTION_DEFAULT_PRIORITY), parse_ttl(ttl, param=param), None,
                           param)
    return retention if retention.priority > 0 else None


@dataclass(frozen=True)
class CacheBreakpoint:
    """An Anthropic-style ``cache_control`` on message ``message_index`` (after its content part ``part_index``, or
    after the whole message when None): the prompt up to there is a prefix to keep cached."""

    message_index: int
    part_index: int | None
    ttl_s: float


MAX_CACHE_BREAKPOINTS = 4
"""As Anthropic allows."""


def cache_breakpoints(request: ChatCompletionRequest) -> list[CacheBreakpoint]:
    """Every ``cache_control`` on a message or a content part, in prompt order; APIError(400) for a malformed one."""
    found = []
    for message_index, message in enumerate(request.messages):
        if isinstance(message.content, list):
            for part_index, part in enumerate(message.content):
                control = part.get("cache_control") if isinstance(part, dict) else None
                if control is not None:
                    found.append(CacheBreakpoint(message_index, part_index, _cache_control_ttl(control)))
        if message.cache_control is not None:
            found.append(CacheBreakpoint(message_index, None, _cache_control_ttl(message.cache_control)))
    if len(found) > MAX_CACHE_BREAKPOINTS:
        raise APIError(f"at most {MAX_CACHE_BREAKPOINTS} cache_control breakpoints are allowed, got {len(found)}",
                       param="messages")
    return found


def _cache_control_ttl(control: Any) -> float:
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise APIError('cache_control must be {"type": "ephemeral", "ttl": "5m" | "1h"}', param="messages")
    return parse_ttl(control.get("ttl", "5m"), param="messages")


def messages_up_to(messages: list[dict[str, str]], request: ChatCompletionRequest,
                   breakpoint: CacheBreakpoint) -> list[dict[str, str]]:
    """The chat messages (as ``chat_messages`` gives them) that end at ``breakpoint``: a breakpoint on a content part
    keeps that message's text parts up to and including it."""
    head = [dict(message) for message in messages[: breakpoint.message_index + 1]]
    if breakpoint.part_index is not None:
        parts = request.messages[breakpoint.message_index].content
        head[-1]["content"] = "".join(part["text"] for part in parts[: breakpoint.part_index + 1])
    return head


def breakpoint_retention(request: ChatCompletionRequest, prefix_len: int, ttl_s: float,
                         whole: Retention | None) -> Retention:
    """The retention of a prompt whose last cache breakpoint ends after ``prefix_len`` tokens; a
    ``prompt_cache_retention`` object given too sets the priority (and a longer TTL)."""
    priority = whole.priority if whole is not None else RETENTION_DEFAULT_PRIORITY
    if whole is not None and whole.ttl_s is not None:
        ttl_s = max(ttl_s, whole.ttl_s)
    return _retention(priority, ttl_s, prefix_len, "messages")


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """APIError(400) unless every id of a token-id prompt is in ``[0, vocab_size)``."""
    bad = [token for token in token_ids if not 0 <= token < vocab_size]
    if bad:
        raise APIError(f"token ids must be in [0, {vocab_size}); got {bad[:5]}", param="prompt")


def sampling_params(request: _SamplingFields, *, prompt_len: int, max_model_len: int, default_max_tokens: int | None
                    ) -> SamplingParams:
    """SamplingParams for ``request``; APIError(400) for values SamplingParams refuses or that overflow the context.

    ``default_max_tokens`` None means "the rest of the context" (chat); the completion default is 16.
    """
    if prompt_len >= max_model_len:
        raise APIError(
            f"the prompt has {prompt_len} tokens; this model serves at most {max_model_len} tokens (prompt + "
            "output), so shorten the prompt",
            param="prompt" if isinstance(request, CompletionRequest) else "messages",
        )
    room = max_model_len - prompt_len
    max_tokens = request.max_tokens
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = min(default_max_tokens, room) if default_max_tokens is not None else room
    elif max_tokens > room:
        raise APIError(
            f"this model's maximum context length is {max_model_len} tokens; you asked for {prompt_len + max_tokens} "
            f"({prompt_len} in the prompt, {max_tokens} to generate); lower max_tokens or shorten the prompt",
            param="max_tokens",
        )
    stop = request.stop
    stop_strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    top_k = request.top_k
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else float(request.temperature),
            top_p=1.0 if request.top_p is None else float(request.top_p),
            top_k=0 if top_k is None or top_k == -1 else top_k,
            seed=request.seed,
            stop=stop_strings,
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
        )
    except ValueError as error:
        raise APIError(str(error), param=_param_named_in(str(error))) from None


_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "stop", "seed")


def _param_named_in(message: str) -> str | None:
    """The first sampling field a SamplingParams error message names."""
    found = [(message.find(name), name) for name in _SAMPLING_FIELDS if name in message]
    return min(found, key=lambda item: (item[0], -len(item[1])))[1] if found else None


# ---- responses --------------------------------------------------------------------------------------------------------
@dataclass
class Usage:
    """Token accounting of one request, from its last RequestOutput."""

    prompt_tokens: int
    completion_tokens: int
    cached: CachedTokens
    cache_write_tokens: int = 0

    @classmethod
    def of(cls, output: RequestOutput) -> "Usage":
        return cls(output.num_prompt_tokens, output.num_output_tokens, output.cached_tokens,
                   output.cache_write_tokens)

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {
                "cached_tokens": self.cached.total,
                "cached_tokens_by_source": self.cached.as_dict(),
                "computed_tokens": self.prompt_tokens - self.cached.total,
                "cache_write_tokens": self.cache_write_tokens,
            },
        }


Kind = Literal["completion", "chat"]


def completion_body(kind: Kind, request_id: str, model: str, text: str, finish_reason: str | None, usage: Usage,
                    replica_id: str, created: int) -> dict[str, Any]:
    if kind == "completion":
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                  "logprobs": None}
        obj = "chat.completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage.body(), "replica_id": replica_id}


def chunk_body(kind: Kind, request_id: str, model: str, created: int, replica_id: str, *, text: str | None = None,
               finish_reason: str | None = None, role: bool = False, usage: Usage | None = None,
               include_usage: bool = False) -> dict[str, Any]:
    """One SSE chunk. ``usage`` given: the final usage-only chunk (no choices)."""
    if usage is not None:
        choices: list[dict[str, Any]] = []
    elif kind == "completion":
        choices = [{"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}]
    else:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion" if kind == "completion" else "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "replica_id": replica_id,
    }
    if usage is not None:
        body["usage"] = usage.body()
    elif include_usage:
        body["usage"] = None
    return body


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
