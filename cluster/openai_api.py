"""The OpenAI-compatible HTTP ingress (FastAPI under ``@serve.ingress``); cluster/app.py makes it a deployment.

Endpoints::

    POST /v1/completions        prompt: string or token-id list; SSE when "stream": true
    POST /v1/chat/completions   messages -> tokenizer.apply_chat_template(add_generation_prompt=True)
    GET  /v1/models             the served model
    GET  /v1/models/{id}        the served model by its name (404 for another)
    GET  /health                200 while the ingress takes requests; 503 while starting and once it drains
    GET  /metrics               Prometheus text (cluster/metrics.py); needs a key when one is configured; cached
    POST /reset_prefix_cache    admin: drops every replica's cached pages (DeploymentHandle.broadcast reaches each)
    POST /admin/drain           admin: stop taking requests, let those in flight finish, end the rest (shutdown)
    GET  /admin/prefixes, POST /admin/prefixes/pin, POST /admin/prefixes/unpin   retained prefixes (cluster/admin_api.py)

A generation request, here, each step bounded before the next does work:

    refuse when draining (503) -> authenticate (401; the pin header needs the admin key, 403) -> read the body up to
    max_request_body_bytes (413) in time (408; cluster/http_io.py) -> parse JSON (depth <= 32, valid Unicode; 400)
    -> validate fields, strict types and ranges, refuse unsupported parameters (400) -> prompt length in characters,
    chat messages counted too (400, before tokenizing) -> tokenize and compute page keys on the one tokenizer
    thread, at most max_pending_tokenizations waiting (429) -> prompt length in tokens (400)
    -> ``replicas.options(stream=True).generate.remote(request)`` (over Serve's gRPC transport unless
    ``--replica-transport ray``): the prefix-aware router reads ``request.page_keys`` and picks the replica; Serve
    refuses beyond max_queued_requests (429 with Retry-After)
    -> await the first output (so a refused request is still a 400 and the replica's id goes in the
    ``x-prefixserve-replica`` header); if that replica dies first, the request is sent once more (another replica)
    -> stream or collect the rest, within request_timeout_s: after the first output, on the replica's output channel
    (one message per engine step for all this ingress's requests there; cluster/output_channels.py) once it is open.

A stream that cannot finish (its replica died, the deadline passed, the server is shutting down) ends with one SSE
error event and ``data: [DONE]``. ``drain()`` (SIGTERM in the CLI) turns new requests away with 503, waits up to
shutdown_timeout_s for those in flight, then cuts the rest that way.

Page keys are computed with the replicas' model fingerprint, asked once from a replica (``info()``) on first use.

With hot-prefix replication on, the ingress owns the replication planner (``cluster/hot_prefix.py``): the router in
this process feeds it, and a task on this loop sends its copies to the replicas, off the request path.
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
import weakref
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import admin_api
from cluster.config import ServeConfig
from cluster.detached import create_detached_task
from cluster.hot_prefix import HotPrefixCopier
from cluster.http_io import api_error_response, read_body
from cluster.metrics import IngressMetrics
from cluster.output_channels import OutputChannels, streaming
from cluster.request_lanes import LaneLost, RequestLanes, lanes_can_route
from cluster.protocol import (
    CHARS_PER_TOKEN_BOUND,
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
    check_prompt_chars,
    check_token_ids,
    check_unsupported,
    chunk_body,
    completion_body,
    completion_prompt,
    error_body,
    now,
    overloaded,
    parse_json_body,
    parse_request,
    sampling_params,
    sse,
)
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import (BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError,
                                  RequestCancelledError)

from common.errors import EngineDeadError, InvalidRequestError, ReplicaFullError
from common.page_keys import compute_page_keys
from common.types import EngineRequest, EngineStats, KVSourceStats, ReplicaInfo, RequestOutput

logger = logging.getLogger(__name__)

BROADCAST_TIMEOUT_S = 30.0
METRICS_TIMEOUT_S = 5.0

UNAVAILABLE_ERRORS = (DeploymentUnavailableError, ReplicaUnavailableError, ActorDiedError, ActorUnavailableError,
                      EngineDeadError)
"""Errors meaning "no replica can serve this now": 503, the client may retry (Ray re-raises a replica's own error as a
subclass of it, so ``isinstance`` sees through the wrapping)."""
REPLICA_LOST_ERRORS = (RayActorError, ReplicaUnavailableError, EngineDeadError, LaneLost)
"""The replica serving a request went away (killed, crashed, stopping): before the first token the request is sent
again, once; after it the stream ends with an error event."""
RETRY_AFTER_S = 1
WARM_UP_RETRY_S = 1.0
"""Start-up: how long the ingress waits before asking the replicas' info again when none answered."""
HEALTH_WAIT_S = 2.0
"""/health while starting: how long it waits for the replicas' info before answering 503 "starting"."""
DRAIN_FLUSH_S = 5.0
"""After cutting the streams still running at the end of a drain: how long they get to send their last event."""

api = FastAPI(title="prefixserve", description="OpenAI-compatible API with prefix caching", docs_url=None,
              redoc_url=None, openapi_url=None)
"""No /docs, /redoc or /openapi.json: FastAPI serves them without any key check, and they would list the admin
routes; the API is OpenAI's (module docstring above)."""


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(exc.detail), type=kind), status_code=exc.status_code)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(error_body(f"invalid request: {exc.errors()}"), status_code=400)


class ReplicaLost(Exception):
    """The replica serving a request went away before the request produced its first output."""


def prompt_chars(request: Any, kind: Kind) -> tuple[int, str]:
    """Characters of the prompt text (a token-id prompt counts its ids), and the field to name in an error.

    A chat message also counts CHARS_PER_TOKEN_BOUND characters for itself: the chat template renders each message
    as at least one token (its role and separators), so many empty messages cost the tokenizer as much as a long
    text and cannot fit the context either."""
    if kind == "completion":
        prompt = request.prompt
        if isinstance(prompt, str):
            return len(prompt), "prompt"
        return sum(len(item) for item in prompt if isinstance(item, (str, list))) or len(prompt), "prompt"
    total = len(request.messages) * CHARS_PER_TOKEN_BOUND
    for message in request.messages:
        content = message.content
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text", "")) for part in content if isinstance(part.get("text"), str))
    return total, "messages"


def call_soon_on(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> None:
    """``callback(*args)`` on ``loop``'s thread, from any thread; nothing once the loop is closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass


def replica_error(error: BaseException) -> APIError:
    """An exception raised by the replica call, as the APIError the client sees."""
    if isinstance(error, (BackPressureError, ReplicaFullError)):
        return overloaded("every replica is full (queue limit reached); retry shortly", RETRY_AFTER_S)
    if isinstance(error, InvalidRequestError):
        message = getattr(error, "cause", None) or error
        return APIError(str(message).strip().splitlines()[-1] if str(message) else "invalid request")
    if isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # the request did not fit one message of Serve's gRPC transport to the replica (4 MiB)
        return APIError(f"the request is too large to send to a replica ({error.details()}); send a shorter one",
                        status=413, code="request_too_large")
    name = type(error).__name__
    if isinstance(error, UNAVAILABLE_ERRORS):
        return APIError(f"no replica can take the request now ({name}); retry later", status=503, type="server_error",
                        retry_after_s=RETRY_AFTER_S)
    logger.exception("request failed in a replica", exc_info=error)
    return APIError(f"the request failed in a replica: {name}", status=500, type="server_error")


def load_tokenizer(files: dict[str, bytes]) -> Any:
    """A fast tokenizer from the files a replica sent (no torch: transformers' AutoTokenizer would import it)."""
    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory(prefix="prefixserve-tokenizer-") as folder:
        for name, data in files.items():
            (Path(folder) / Path(name).name).write_bytes(data)
        return PreTrainedTokenizerFast.from_pretrained(folder)


def _bearer_matches(request: Request, keys: tuple[str, ...]) -> bool:
    """Whether ``Authorization: Bearer <token>`` carries one of ``keys`` (constant-time comparisons)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = token.strip().encode()
    return any(hmac.compare_digest(given, key.encode()) for key in keys)


@serve.ingress(api)
class OpenAIIngress:
    """The ingress. ``replicas`` is the handle of the ServeReplica deployment; ``config`` the whole ServeConfig."""

    def __init__(self, replicas: Any, config: ServeConfig) -> None:
        """The tokenizer comes with the replicas' ``ReplicaInfo``, asked once on first use."""
        logging.getLogger("cluster").setLevel(config.log_level.upper())
        self.replicas = replicas
        self._generate_handle: Any = None
        """``replicas.generate`` for streamed calls over the configured transport (made on first use)."""
        self.config = config
        self.served_model_name = config.served_model_name
        self.tokenizer = None
        self.metrics = IngressMetrics(model_name=self.served_model_name)
        # One thread: a fast tokenizer is not safe to call from several threads at once ("Already borrowed").
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._num_tokenizing = 0
        self._info: ReplicaInfo | None = None
        self._info_lock = asyncio.Lock()
        # in flight: generation requests accepted and not yet answered in full; the replica streams among them
        self._num_inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._request_to_stream: dict[str, Any] = {}
        self._request_to_cut: dict[str, str] = {}
        """Requests whose replica stream this ingress cancelled, and why: "deadline" | "shutdown"."""
        self._metrics_body = b""
        self._metrics_at = -float("inf")
        self._metrics_lock = asyncio.Lock()
        self.hot_prefix = self._hot_prefix_copier(replicas, config)
        self.output_channels = (OutputChannels(replicas, self.metrics, lambda: self._num_inflight,
                                               transport=config.replica_transport)
                                if config.output_channels else None)
        self.request_lanes = (RequestLanes(replicas, lambda handle: streaming(handle, config.replica_transport),
                                           self.metrics)
                              if config.request_lanes and lanes_can_route() else None)
        self._warm_task: asyncio.Task | None = None
        self._start_warm_up()

    @staticmethod
    def _hot_prefix_copier(replicas: Any, config: ServeConfig) -> "HotPrefixCopier | None":
        """Hot-prefix replication (cluster/hot_prefix.py), when on: its planner is fed by this process's router."""
        if not config.enable_hot_prefix_replication or getattr(replicas, "deployment_id", None) is None:
            return None
        return HotPrefixCopier(replicas, config.replication_config())

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
        return JSONResponse({"object": "list", "data": [self._model_card(info)]})

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> Response:
        """OpenAI's "retrieve model" (the official client's ``models.retrieve``): the served model, or a 404."""
        try:
            self._check_api_key(request)
            self._check_model(model_id)
            info = await self._replica_info()
        except APIError as error:
            return api_error_response(error)
        return JSONResponse(self._model_card(info))

    def _model_card(self, info) -> dict:
        return {"id": self.served_model_name, "object": "model", "created": now(), "owned_by": "prefixserve",
                "root": self.config.model or self.served_model_name, "max_model_len": info.max_model_len}

    @api.get("/health")
    async def health(self) -> Response:
        """200 while requests are taken; 503 while starting (no replica has answered yet: a request now would wait
        for one) and once draining, so load balancers send nothing here then."""
        if self._draining:
            return Response(status_code=503)
        if self._info is None:
            self._start_warm_up()
            try:
                await asyncio.wait_for(asyncio.shield(self._warm_task), HEALTH_WAIT_S)
            except Exception:  # noqa: BLE001 - a timeout, or the warm-up task ended without the info
                return JSONResponse({"status": "starting"}, status_code=503)
        return Response(status_code=200)

    def _start_warm_up(self) -> None:
        """Ask the replicas' info and load the tokenizer in the background from start-up, so the first request does
        not (0.8 s on 2 cores); retried until a replica answers. Needs a running loop (Serve constructs the ingress
        on one); without one, ``health`` starts it. It belongs to no request (cluster/detached.py): a /health
        client hanging up must not cancel the replica call that every request waiting for the info shares."""
        if self._warm_task is not None and not self._warm_task.done():
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._warm_task = create_detached_task(self._warm_up())

    async def _warm_up(self) -> None:
        while self._info is None and not self._draining:
            try:
                await self._replica_info()
            except Exception as error:  # noqa: BLE001 - no replica yet, or its tokenizer failed: asked again
                logger.debug("start-up: the replicas' info is not there yet (%s)", error)
                await asyncio.sleep(WARM_UP_RETRY_S)

    @api.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Prometheus text, rendered at most once per ``metrics_cache_s`` (concurrent scrapers share one render)."""
        try:
            self._check_key(request, self.config.metrics_api_keys)
        except APIError as error:
            return api_error_response(error)
        loop = asyncio.get_running_loop()
        if loop.time() - self._metrics_at >= self.config.metrics_cache_s:
            async with self._metrics_lock:
                if loop.time() - self._metrics_at >= self.config.metrics_cache_s:
                    self._metrics_body = await self._render_metrics()
                    self._metrics_at = loop.time()
        return Response(self._metrics_body, media_type=CONTENT_TYPE_LATEST)

    @api.post("/reset_prefix_cache")
    async def reset_prefix_cache(self, request: Request) -> Response:
        """Admin: reset every replica's prefix cache. 200 with ``{"num_replicas", "all_reset"}``; ``all_reset`` is
        false when some replica kept pages that running requests still use."""
        try:
            self._check_admin_key(request)
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

    @api.post("/admin/drain")
    async def admin_drain(self, request: Request) -> Response:
        """Admin: ``drain()`` over HTTP (``?timeout_s=``), for deployments not started by the CLI."""
        try:
            self._check_admin_key(request)
            raw = request.query_params.get("timeout_s")
            timeout_s = float(raw) if raw is not None else None
            if timeout_s is not None and not 0 <= timeout_s <= 3600:
                raise ValueError
        except APIError as error:
            return api_error_response(error)
        except ValueError:
            return api_error_response(APIError("timeout_s must be a number of seconds in [0, 3600]",
                                               param="timeout_s"))
        return JSONResponse(await self.drain(timeout_s))

    async def drain(self, timeout_s: float | None = None) -> dict[str, int]:
        """Stop taking requests (503, /health unready), wait up to ``timeout_s`` (default shutdown_timeout_s) for the
        ones in flight, then end the rest with an SSE error event and [DONE]. Returns how many completed and how many
        were cut; calling it again only waits again."""
        self._draining = True
        if self.hot_prefix is not None:
            self.hot_prefix.stop()
        timeout_s = self.config.shutdown_timeout_s if timeout_s is None else timeout_s
        num_at_start = self._num_inflight
        logger.info("draining: %d request(s) in flight, waiting up to %.0f s", num_at_start, timeout_s)
        await self._wait_idle(timeout_s)
        to_cut = list(self._request_to_stream)
        for request_id in to_cut:
            self._cut(request_id, "shutdown")
        if to_cut:
            await self._wait_idle(DRAIN_FLUSH_S)
        if self.output_channels is not None:
            self.output_channels.close()  # nothing bound is left: the replicas stop waiting on them
        if self.request_lanes is not None:
            self.request_lanes.close()
        num_cut = len(to_cut)
        num_completed = max(0, num_at_start - num_cut)
        self.metrics.drained.labels("completed").inc(num_completed)
        self.metrics.drained.labels("aborted").inc(num_cut)
        logger.info("drained: %d completed, %d ended early, %d still open", num_completed, num_cut,
                    self._num_inflight)
        return {"completed": num_completed, "aborted": num_cut, "still_open": self._num_inflight}

    # ---- generation ------------------------------------------------------------------------------------------------
    async def _serve_generation(self, http_request: Request, kind: Kind) -> Response:
        if self._draining:
            self.metrics.rejected.labels("shutting_down").inc()
            return api_error_response(APIError("the server is shutting down; send the request to another instance",
                                               status=503, type="server_error", code="shutting_down",
                                               retry_after_s=RETRY_AFTER_S))
        self._enter()
        if self.hot_prefix is not None:
            self.hot_prefix.ensure_started()
        handed_to_stream = False
        try:
            response = await self._generation_response(http_request, kind)
            handed_to_stream = isinstance(response, StreamingResponse)  # it leaves when its stream ends
            return response
        finally:
            if not handed_to_stream:
                self._leave()

    async def _generation_response(self, http_request: Request, kind: Kind) -> Response:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.request_timeout_s
        try:
            self._check_api_key(http_request)
            target = self._target_replica(http_request)
            body = parse_json_body(await read_body(http_request, self.config.max_request_body_bytes))
            request = parse_request(CompletionRequest if kind == "completion" else ChatCompletionRequest, body)
            check_unsupported(request)
            self._check_model(request.model)
            info = await self._replica_info()
            num_chars, param = prompt_chars(request, kind)
            check_prompt_chars(num_chars, max_chars=self._max_prompt_chars(info), param=param)
            started = time.perf_counter()
            engine_request = await self._tokenize(request, kind, info)
            if target:
                engine_request = dataclasses.replace(engine_request, target_replica=target)
        except APIError as error:
            self.metrics.rejected.labels(error.reason).inc()
            return api_error_response(error)
        request_id = ("cmpl-" if kind == "completion" else "chatcmpl-") + engine_request.request_id
        for attempt in range(2):
            try:
                return await self._generate(kind, request, request_id, engine_request, started, deadline)
            except ReplicaLost as lost:
                if attempt == 1:
                    error = APIError(f"the replica serving the request was lost twice ({lost}); retry later",
                                     status=503, type="server_error", code="replica_lost",
                                     retry_after_s=RETRY_AFTER_S)
                    self.metrics.observe_aborted("replica_lost", None, key=engine_request.request_id)
                    return api_error_response(error)
                self.metrics.retried.inc()
                logger.warning("request %s: its replica was lost before the first token (%s); sending it again",
                               request_id, lost)
                # a new engine id: a replica that only seemed lost may still run the first attempt under the old one
                engine_request = dataclasses.replace(engine_request, request_id=uuid.uuid4().hex)
            except APIError as error:
                self.metrics.rejected.labels(error.reason).inc()
                return api_error_response(error)
        raise AssertionError("unreachable")

    async def _generate(self, kind: Kind, request: Any, request_id: str, engine_request: EngineRequest,
                        started: float, deadline: float) -> Response:
        """One attempt on one replica: ReplicaLost when it died before producing anything the client saw."""
        key = engine_request.request_id
        if self.request_lanes is not None:
            stream = await self.request_lanes.open_stream(engine_request, self._through_handle)
        else:
            stream = self._through_handle(engine_request)
        self._request_to_stream[key] = stream
        timer = asyncio.get_running_loop().call_at(deadline, self._cut, key, "deadline")
        handed_to_stream = False
        first = None
        try:
            first = await self._first_output(key, stream)
            self.metrics.observe_first_token(time.perf_counter() - started, first)
            headers = {REPLICA_HEADER: first.replica_id}
            if request.stream:
                events = self._stream_events(kind, request_id, request.include_usage, first, stream, key, timer)
                # the stream's own finally cleans up; a client gone before it started leaves it never iterated
                # (on the event loop: the collector may run the finalizer on any thread)
                weakref.finalize(events, call_soon_on, asyncio.get_running_loop(), self._end_unstarted_stream, key,
                                 stream, timer, first.replica_id)
                handed_to_stream = True
                return StreamingResponse(events, media_type="text/event-stream", headers=headers)
            return JSONResponse(await self._collect(kind, request_id, first, stream, key), headers=headers)
        except asyncio.CancelledError:
            # Serve cancels the handler when its client goes away (and a call through the handle with it; a request
            # lane's is cancelled here): an abort, counted as a stream's is (a stream handed over counts its own)
            stream.cancel()
            self.metrics.observe_aborted("client_gone", first.replica_id if first is not None else None, key)
            raise
        finally:
            if not handed_to_stream:
                timer.cancel()
                self._request_to_stream.pop(key, None)
                self._request_to_cut.pop(key, None)

    async def _tokenize(self, request: Any, kind: Kind, info: ReplicaInfo) -> EngineRequest:
        """``_engine_request`` on the tokenizer thread; 429 when too many requests already wait for it."""
        if self._num_tokenizing >= self.config.max_pending_tokenizations:
            raise overloaded("too many requests are waiting to be tokenized; retry shortly", RETRY_AFTER_S)
        self._num_tokenizing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenize_pool, self._engine_request, request, kind, info
            )
        finally:
            self._num_tokenizing -= 1

    def _engine_request(self, request: Any, kind: Kind, info: ReplicaInfo) -> EngineRequest:
        """Tokenize, build sampling params and page keys (CPU work: runs on the tokenizer thread)."""
        if kind == "completion":
            prompt = completion_prompt(request)
            if isinstance(prompt, list):
                if len(prompt) >= info.max_model_len:
                    raise APIError(f"the prompt has {len(prompt)} tokens; this model serves at most "
                                   f"{info.max_model_len} tokens (prompt + output)", param="prompt")
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

    def _through_handle(self, engine_request: EngineRequest) -> Any:
        """The request's stream through Serve's handle (and this ingress's output channel, once open)."""
        channels = self.output_channels
        if channels is not None:
            engine_request = dataclasses.replace(engine_request, output_channel=channels.channel_id)
        if self._generate_handle is None:  # one for every request: options() and .generate cost ~0.1 ms a call
            self._generate_handle = streaming(self.replicas, self.config.replica_transport).generate
        stream = self._generate_handle.remote(engine_request)
        return channels.stream(engine_request.request_id, stream) if channels is not None else stream

    async def _first_output(self, key: str, stream: Any) -> RequestOutput:
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            raise APIError("the replica ended the request without output", status=500, type="server_error") from None
        except RequestCancelledError:
            raise self._cut_error(key) from None
        except REPLICA_LOST_ERRORS as error:
            raise ReplicaLost(type(error).__name__) from None
        except Exception as error:  # noqa: BLE001 - mapped to an HTTP status
            raise replica_error(error) from None

    async def _collect(self, kind: Kind, request_id: str, first: RequestOutput, stream: Any,
                       key: str) -> dict[str, Any]:
        """The whole response of a non-streamed request (nothing was sent yet, so a lost replica means a retry)."""
        texts = [first.new_text]
        output = first
        try:
            while not output.finished:
                output = await stream.__anext__()
                texts.append(output.new_text)
        except StopAsyncIteration:
            raise APIError("the replica ended the request early", status=500, type="server_error") from None
        except RequestCancelledError:
            self.metrics.observe_aborted(self._request_to_cut.get(key, "cancelled"), first.replica_id, key)
            raise self._cut_error(key) from None
        except REPLICA_LOST_ERRORS as error:
            raise ReplicaLost(type(error).__name__) from None
        except Exception as error:  # noqa: BLE001 - mapped to an HTTP status
            raise replica_error(error) from None
        self.metrics.observe_finished(output)
        return completion_body(kind, request_id, self.served_model_name, "".join(texts), output.finish_reason,
                               Usage.of(output), output.replica_id, now())

    async def _stream_events(self, kind: Kind, request_id: str, include_usage: bool, first: RequestOutput,
                             stream: Any, key: str, timer: asyncio.TimerHandle) -> AsyncIterator[str]:
        """SSE: chunks of text, the finish reason, optionally a usage chunk, then ``data: [DONE]``.

        A failure mid-stream (replica lost, deadline, shutdown) is sent as one error event before [DONE]; a client that
        goes away cancels the call."""
        created = now()
        model = self.served_model_name
        replica_id = first.replica_id
        output = first
        num_tokens = 0
        completed = False
        try:
            try:
                if kind == "chat":
                    yield sse(chunk_body(kind, request_id, model, created, replica_id, role=True,
                                         include_usage=include_usage))
                while True:
                    num_tokens += len(output.new_token_ids)
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
                completed = True
            except StopAsyncIteration:
                self.metrics.observe_aborted("replica_ended", replica_id, key)
                yield sse(error_body("the replica ended the request early", type="server_error"))
            except RequestCancelledError:
                reason = self._request_to_cut.get(key, "cancelled")
                self.metrics.observe_aborted(reason, replica_id, key)
                yield sse(self._cut_error(key, num_tokens).body())
            except REPLICA_LOST_ERRORS as error:
                self.metrics.observe_aborted("replica_lost", replica_id, key)
                yield sse(error_body(f"the replica serving this request was lost ({type(error).__name__}) after "
                                     f"{num_tokens} tokens were sent; send the request again", type="server_error",
                                     code="replica_lost"))
            except Exception as error:  # noqa: BLE001 - reported in the stream
                self.metrics.observe_aborted("error", replica_id, key)
                yield sse(replica_error(error).body())
            yield SSE_DONE
        except (asyncio.CancelledError, GeneratorExit):
            if not completed:
                self.metrics.observe_aborted("client_gone", replica_id, key)
            raise
        finally:
            timer.cancel()
            if not output.finished:
                stream.cancel()
            self._request_to_stream.pop(key, None)
            self._request_to_cut.pop(key, None)
            self._leave()

    def _end_unstarted_stream(self, key: str, stream: Any, timer: asyncio.TimerHandle, replica_id: str = "") -> None:
        """An SSE response dropped before its generator ran (the client went away first): what its finally would do.
        A no-op when the generator ran (it removed ``key``)."""
        if self._request_to_stream.get(key) is not stream:
            return
        timer.cancel()
        stream.cancel()
        self._request_to_stream.pop(key, None)
        self._request_to_cut.pop(key, None)
        self.metrics.observe_aborted("client_gone", replica_id, key)
        self._leave()

    # ---- in flight, deadlines, drain -------------------------------------------------------------------------------
    def _enter(self) -> None:
        self._num_inflight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._num_inflight -= 1
        if self._num_inflight <= 0:
            self._num_inflight = 0
            self._idle.set()

    async def _wait_idle(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def _cut(self, key: str, reason: str) -> None:
        """End a request's replica stream early; its reader then reports ``reason`` to the client."""
        stream = self._request_to_stream.get(key)
        if stream is not None and key not in self._request_to_cut:
            self._request_to_cut[key] = reason
            stream.cancel()

    def _cut_error(self, key: str, num_tokens: int | None = None) -> APIError:
        reason = self._request_to_cut.get(key)
        sent = f" after {num_tokens} tokens" if num_tokens is not None else ""
        if reason == "shutdown":
            return APIError(f"the server is shutting down; the request was ended{sent}", status=503,
                            type="server_error", code="shutting_down", retry_after_s=RETRY_AFTER_S)
        if reason == "deadline":
            return APIError(f"the request ran past its deadline of {self.config.request_timeout_s:g} s{sent}",
                            status=504, type="timeout_error", code="timeout")
        return APIError(f"the request was cancelled{sent}", status=500, type="server_error")

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def _max_prompt_chars(self, info: ReplicaInfo) -> int:
        return self.config.max_prompt_chars or info.max_model_len * CHARS_PER_TOKEN_BOUND

    async def _render_metrics(self) -> bytes:
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
        return self.metrics.render(replica_stats, kv_sources,
                                   self.hot_prefix.planner.snapshot() if self.hot_prefix is not None else None)

    async def _replica_info(self) -> ReplicaInfo:
        """The replicas' model fingerprint, max_model_len and page size, asked once."""
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    try:
                        info = await self.replicas.info.remote()
                    except Exception as error:  # noqa: BLE001 - no replica answered
                        raise APIError(f"no replica is ready yet ({type(error).__name__}); retry shortly",
                                       status=503, type="server_error", retry_after_s=RETRY_AFTER_S) from None
                    self.tokenizer = await asyncio.get_running_loop().run_in_executor(
                        self._tokenize_pool, load_tokenizer, info.tokenizer_files)
                    self._info = info
        return self._info

    def _check_api_key(self, request: Request) -> None:
        """/v1/*: open without --api-key; else the client key, or the admin key (which can do everything)."""
        if self.config.api_key:
            self._check_key(request, tuple(key for key in (self.config.api_key, self.config.admin_api_key) if key))

    def _check_admin_key(self, request: Request) -> None:
        admin = self.config.effective_admin_api_key
        self._check_key(request, (admin,) if admin else ())

    def _target_replica(self, request: Request) -> str | None:
        """The pin header's replica; only the admin key may pin (403 otherwise, when an admin key is configured)."""
        target = request.headers.get(TARGET_REPLICA_HEADER)
        if not target:
            return None
        admin = self.config.effective_admin_api_key
        if admin and not _bearer_matches(request, (admin,)):
            raise APIError(f"the {TARGET_REPLICA_HEADER} header needs the admin key", status=403,
                           type="permission_error", code="forbidden")
        return target.strip()[:128]

    @staticmethod
    def _check_key(request: Request, keys: tuple[str, ...]) -> None:
        """401 unless ``keys`` is empty (open) or the bearer token is one of them."""
        if keys and not _bearer_matches(request, keys):
            raise APIError("missing or wrong API key; send 'Authorization: Bearer <key>'", status=401,
                           code="invalid_api_key")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            shown = model if len(model) <= 200 else model[:200] + "..."  # a huge name is not echoed back whole
            raise APIError(f"the model {shown!r} does not exist; this server serves {self.served_model_name!r}",
                           status=404, type="not_found_error", param="model", code="model_not_found")

