"""The OpenAI-compatible HTTP ingress (FastAPI under ``@serve.ingress``); cluster/app.py makes it a deployment.

Endpoints::

    POST /v1/completions        prompt: string or token-id list; SSE when "stream": true
    POST /v1/chat/completions   messages -> tokenizer.apply_chat_template(add_generation_prompt=True)
    GET  /v1/models             the served model
    GET  /health                200 while the ingress is up
    GET  /metrics               Prometheus text (cluster/metrics.py)
    POST /reset_prefix_cache    drops every replica's cached pages (DeploymentHandle.broadcast reaches each replica)
    GET  /admin/prefixes, POST /admin/prefixes/pin, POST /admin/prefixes/unpin   retained prefixes (cluster/admin_api.py)

A generation request, here: authenticate -> parse and validate (APIError -> 400) -> tokenize and compute page keys
(on one tokenizer thread: CPU work stays off the event loop) -> ``replicas.options(stream=True).generate.remote(request)``,
where the prefix-aware router reads ``request.page_keys`` and picks the replica -> await the first output before
answering, so a request the replica refuses (``InvalidRequestError``) is still a 400 and the replica's id can go in the
``x-prefixserve-replica`` header -> stream or collect the rest. A request carrying ``x-prefixserve-target-replica:
<replica id>`` is pinned to that replica (the router still names the best holder as peer_hint, so it can copy).

Page keys are computed with the replicas' model fingerprint, asked once from a replica (``info()``) on first use.
"""

# No ``from __future__ import annotations`` here: FastAPI must see the real ``Request`` annotation on the methods that
# Serve's ingress re-binds, or it reads ``request`` as a query parameter.
import asyncio
import concurrent.futures
import dataclasses
import hmac
import logging
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import admin_api
from cluster.config import ServeConfig
from cluster.metrics import IngressMetrics
from cluster.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    REPLICA_HEADER,
    TARGET_REPLICA_HEADER,
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Kind,
    Usage,
    breakpoint_retention,
    cache_breakpoints,
    chat_messages,
    messages_up_to,
    request_retention,
    check_token_ids,
    check_unsupported,
    chunk_body,
    completion_body,
    completion_prompt,
    error_body,
    now,
    parse_json_body,
    parse_request,
    sampling_params,
    sse,
)
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from common.errors import EngineDeadError, InvalidRequestError
from common.page_keys import compute_page_keys
from common.types import EngineRequest, EngineStats, KVSourceStats, ReplicaInfo, RequestOutput

logger = logging.getLogger(__name__)

BROADCAST_TIMEOUT_S = 30.0
METRICS_TIMEOUT_S = 5.0

UNAVAILABLE_ERRORS = (BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError, ActorDiedError,
                      ActorUnavailableError, EngineDeadError)
"""Errors meaning "no replica can serve this now": 503, the client may retry (Ray re-raises a replica's own error as a
subclass of it, so ``isinstance`` sees through the wrapping)."""

api = FastAPI(title="prefixserve", description="OpenAI-compatible API with prefix caching")


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(exc.detail), type=kind), status_code=exc.status_code)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(error_body(f"invalid request: {exc.errors()}"), status_code=400)


def api_error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def replica_error(error: BaseException) -> APIError:
    """An exception raised by the replica call, as the APIError the client sees."""
    if isinstance(error, InvalidRequestError):
        message = getattr(error, "cause", None) or error
        return APIError(str(message).strip().splitlines()[-1] if str(message) else "invalid request")
    name = type(error).__name__
    if isinstance(error, UNAVAILABLE_ERRORS):
        return APIError(f"no replica can take the request now ({name}); retry later", status=503, type="server_error")
    logger.exception("request failed in a replica", exc_info=error)
    return APIError(f"the request failed in a replica: {name}", status=500, type="server_error")


def load_tokenizer(files: dict[str, bytes]) -> Any:
    """A fast tokenizer from the files a replica sent (no torch: transformers' AutoTokenizer would import it)."""
    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory(prefix="prefixserve-tokenizer-") as folder:
        for name, data in files.items():
            (Path(folder) / Path(name).name).write_bytes(data)
        return PreTrainedTokenizerFast.from_pretrained(folder)


@serve.ingress(api)
class OpenAIIngress:
    """The ingress. ``replicas`` is the handle of the ServeReplica deployment; ``config`` the whole ServeConfig."""

    def __init__(self, replicas: Any, config: ServeConfig) -> None:
        """The tokenizer comes with the replicas' ``ReplicaInfo``, asked once on first use."""
        logging.getLogger("cluster").setLevel(config.log_level.upper())
        self.replicas = replicas
        self.config = config
        self.served_model_name = config.served_model_name
        self.tokenizer = None
        self.metrics = IngressMetrics(model_name=self.served_model_name)
        # One thread: a fast tokenizer is not safe to call from several threads at once ("Already borrowed").
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._info: ReplicaInfo | None = None
        self._info_lock = asyncio.Lock()

    # ---- endpoints -------------------------------------------------------------------------------------------------
    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve_generation(request, "completion")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve_generation(request, "chat")

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._check_api_key(request)
            info = await self._replica_info()
        except APIError as error:
            return api_error_response(error)
        card = {"id": self.served_model_name, "object": "model", "created": now(), "owned_by": "prefixserve",
                "root": self.config.model or self.served_model_name, "max_model_len": info.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @api.get("/health")
    async def health(self) -> Response:
        return Response(status_code=200)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        replica_stats: list[EngineStats] = []
        kv_sources: list[KVSourceStats] = []
        try:
            results, sources = await asyncio.gather(
                self.replicas.broadcast("stats").results_async(timeout_s=METRICS_TIMEOUT_S, return_exceptions=True),
                self.replicas.broadcast("kv_source_stats").results_async(
                    timeout_s=METRICS_TIMEOUT_S, return_exceptions=True
                ),
            )
            replica_stats = [item for item in results if isinstance(item, EngineStats)]
            kv_sources = [item for item in sources if isinstance(item, KVSourceStats)]
        except Exception:  # noqa: BLE001 - the ingress's own metrics are still worth serving
            logger.warning("could not read the replicas' stats for /metrics", exc_info=True)
        return Response(self.metrics.render(replica_stats, kv_sources), media_type=CONTENT_TYPE_LATEST)

    @api.post("/reset_prefix_cache")
    async def reset_prefix_cache(self, request: Request) -> Response:
        """Reset every replica's prefix cache. 200 with ``{"num_replicas", "all_reset"}``; ``all_reset`` is false when
        some replica kept pages that running requests still use."""
        try:
            self._check_api_key(request)
        except APIError as error:
            return api_error_response(error)
        try:
            results = await self.replicas.broadcast("reset_prefix_cache").results_async(timeout_s=BROADCAST_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - reported to the caller
            return api_error_response(APIError(f"resetting the prefix caches failed: {error!r}", status=500,
                                               type="server_error"))
        return JSONResponse({"status": "ok", "num_replicas": len(results), "all_reset": all(bool(r) for r in results)})

    @api.get("/admin/prefixes")
    async def admin_list_prefixes(self, request: Request) -> Response:
        return await admin_api.list_prefixes(self, request)

    @api.post("/admin/prefixes/pin")
    async def admin_pin_prefix(self, request: Request) -> Response:
        return await admin_api.pin_prefix(self, request)

    @api.post("/admin/prefixes/unpin")
    async def admin_unpin_prefix(self, request: Request) -> Response:
        return await admin_api.unpin_prefix(self, request)

    # ---- generation ------------------------------------------------------------------------------------------------
    async def _serve_generation(self, http_request: Request, kind: Kind) -> Response:
        try:
            self._check_api_key(http_request)
            body = parse_json_body(await http_request.body())
            request = parse_request(CompletionRequest if kind == "completion" else ChatCompletionRequest, body)
            check_unsupported(request)
            self._check_model(request.model)
            info = await self._replica_info()
            started = time.perf_counter()
            engine_request = await asyncio.get_running_loop().run_in_executor(
                self._tokenize_pool, self._engine_request, request, kind, info
            )
            target = http_request.headers.get(TARGET_REPLICA_HEADER)
            if target:
                engine_request = dataclasses.replace(engine_request, target_replica=target)
            stream = self.replicas.options(stream=True).generate.remote(engine_request)
            first = await self._first_output(stream)
        except APIError as error:
            return api_error_response(error)
        self.metrics.observe_first_token(time.perf_counter() - started, first)
        request_id = ("cmpl-" if kind == "completion" else "chatcmpl-") + engine_request.request_id
        headers = {REPLICA_HEADER: first.replica_id}
        if request.stream:
            events = self._stream_events(kind, request_id, request.include_usage, first, stream)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            return JSONResponse(await self._collect(kind, request_id, first, stream), headers=headers)
        except APIError as error:
            return api_error_response(error)

    def _engine_request(self, request: Any, kind: Kind, info: ReplicaInfo) -> EngineRequest:
        """Tokenize, build sampling params and page keys (CPU work: runs on the tokenizer thread)."""
        if kind == "completion":
            prompt = completion_prompt(request)
            if isinstance(prompt, list):
                check_token_ids(prompt, info.vocab_size)
                token_ids = prompt
            else:
                token_ids = self.tokenizer(prompt).input_ids
            default_max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
        else:
            messages = chat_messages(request)
            token_ids = self._apply_chat_template(messages)
            default_max_tokens = None
        retention = request_retention(request)
        if kind == "chat" and info.enable_prefix_caching:
            retention = self._breakpoint_retention(request, messages, token_ids, retention)
        sampling = sampling_params(
            request, prompt_len=len(token_ids), max_model_len=info.max_model_len, default_max_tokens=default_max_tokens
        )
        page_keys = None
        if info.enable_prefix_caching:
            page_keys = compute_page_keys(
                token_ids, page_size=info.page_size, model_fingerprint=info.model_fingerprint, salt=request.cache_salt
            )
        return EngineRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=list(token_ids),
            sampling=sampling,
            cache_salt=request.cache_salt,
            page_keys=page_keys,
            retention=retention if info.enable_prefix_caching else None,
        )

    def _breakpoint_retention(self, request: Any, messages: list[dict[str, str]], token_ids: list[int],
                              retention: Any) -> Any:
        """With ``cache_control`` breakpoints: retain the prompt up to the last one (its token length is where the
        rendered messages up to the breakpoint stop agreeing with the whole prompt), with the longest TTL given."""
        breakpoints = cache_breakpoints(request)
        if not breakpoints:
            return retention
        head = self._apply_chat_template(messages_up_to(messages, request, breakpoints[-1]),
                                         add_generation_prompt=False)
        prefix_len = 0
        for own, whole in zip(head, token_ids):
            if own != whole:
                break
            prefix_len += 1
        return breakpoint_retention(request, prefix_len, max(b.ttl_s for b in breakpoints), retention)

    def _apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        except Exception as error:  # noqa: BLE001 - no template, or the template refused the messages
            raise APIError(f"the chat template could not render the messages: {error}", param="messages") from None
        return self.tokenizer(text, add_special_tokens=False).input_ids

    async def _first_output(self, stream: Any) -> RequestOutput:
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            raise APIError("the replica ended the request without output", status=500, type="server_error") from None
        except Exception as error:  # noqa: BLE001 - mapped to an HTTP status
            raise replica_error(error) from None

    async def _collect(self, kind: Kind, request_id: str, first: RequestOutput, stream: Any) -> dict[str, Any]:
        texts = [first.new_text]
        output = first
        try:
            while not output.finished:
                output = await stream.__anext__()
                texts.append(output.new_text)
        except StopAsyncIteration:
            raise APIError("the replica ended the request early", status=500, type="server_error") from None
        except Exception as error:  # noqa: BLE001 - mapped to an HTTP status
            raise replica_error(error) from None
        self.metrics.observe_finished(output)
        return completion_body(kind, request_id, self.served_model_name, "".join(texts), output.finish_reason,
                               Usage.of(output), output.replica_id, now())

    async def _stream_events(self, kind: Kind, request_id: str, include_usage: bool, first: RequestOutput,
                             stream: Any) -> AsyncIterator[str]:
        """SSE: chunks of text, the finish reason, optionally a usage chunk, then ``data: [DONE]``.

        A failure mid-stream is sent as one error event before [DONE]; a client that goes away cancels the call."""
        created = now()
        model = self.served_model_name
        replica_id = first.replica_id
        output = first
        try:
            if kind == "chat":
                yield sse(chunk_body(kind, request_id, model, created, replica_id, role=True,
                                     include_usage=include_usage))
            while True:
                if output.new_text or output.finished:
                    yield sse(chunk_body(kind, request_id, model, created, replica_id, text=output.new_text,
                                         finish_reason=output.finish_reason if output.finished else None,
                                         include_usage=include_usage))
                if output.finished:
                    break
                output = await stream.__anext__()
            self.metrics.observe_finished(output)
            if include_usage:
                yield sse(chunk_body(kind, request_id, model, created, replica_id, usage=Usage.of(output)))
        except StopAsyncIteration:
            yield sse(error_body("the replica ended the request early", type="server_error"))
        except Exception as error:  # noqa: BLE001 - reported in the stream
            yield sse(replica_error(error).body())
        finally:
            if not output.finished:
                stream.cancel()
        yield SSE_DONE

    # ---- helpers ---------------------------------------------------------------------------------------------------
    async def _replica_info(self) -> ReplicaInfo:
        """The replicas' model fingerprint, max_model_len and page size, asked once."""
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    try:
                        info = await self.replicas.info.remote()
                    except Exception as error:  # noqa: BLE001 - no replica answered
                        raise APIError(f"no replica is ready yet ({type(error).__name__}); retry shortly",
                                       status=503, type="server_error") from None
                    self.tokenizer = await asyncio.get_running_loop().run_in_executor(
                        self._tokenize_pool, load_tokenizer, info.tokenizer_files)
                    self._info = info
        return self._info

    def _check_api_key(self, request: Request) -> None:
        expected = self.config.api_key
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
            raise APIError("missing or wrong API key; send 'Authorization: Bearer <key>'", status=401,
                           code="invalid_api_key")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(f"the model {model!r} does not exist; this server serves {self.served_model_name!r}",
                           status=404, type="not_found_error", param="model", code="model_not_found")
