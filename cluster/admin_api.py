"""Admin endpoints for retained prefixes, mounted on the ingress by cluster/openai_api.py. They need the admin key
(``--admin-api-key``; the API key where no admin key is set): a listing shows the start of other clients' prompts,
and a pin spends the retention budget every client shares.

    GET  /admin/prefixes         every retained prefix (admin pins and request retentions), merged over the replicas:
                                 priority, TTL, hits, cached tokens, and where it lives (pages per replica)
    POST /admin/prefixes/pin     {"prompt": "..." | [token ids]} or {"messages": [...]}, optional "priority" (0..100,
                                 default 100), "ttl" (seconds or "5m"/"1h"/"24h"; default null: until unpinned),
                                 "cache_salt" (at most 1024 characters), "warm" (default true: compute the prefix on
                                 one replica now if none holds it; when that fails the pin is taken back)
    POST /admin/prefixes/unpin   {"prefix_id": "..."} or the same "prompt" / "messages" as pin

A prefix is the prompt's leading full pages (a partial last page is not cached, so not pinned); chat messages are
rendered with the chat template without the generation prompt, so a later request starting with the same messages
shares the pages. Pins are soft: pinned pages are evicted only after every lower-priority page, and at most
``--kv-cache-retention-budget`` of a replica's pages hold a retention at once.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from cluster.http_io import api_error_response, read_body
from cluster.output_channels import streaming
from cluster.protocol import (
    MAX_CACHE_SALT_CHARS,
    MAX_CHAT_MESSAGES,
    APIError,
    ChatMessage,
    parse_json_body,
    parse_request,
    parse_ttl,
)
from common.errors import InvalidRequestError
from common.page_keys import compute_page_keys, prefix_id_of
from common.types import RETENTION_MAX_PRIORITY, EngineRequest, PinPrefix, PrefixReport, Retention, SamplingParams

logger = logging.getLogger(__name__)

ADMIN_TIMEOUT_S = 30.0
MAX_LABEL_CHARS = 80


class PrefixSpec(BaseModel):
    """The body of a pin or unpin; strict types as for /v1 requests (``"ttl": true`` is a 400, not one second)."""

    model_config = ConfigDict(extra="forbid")
    prompt: Union[str, list[StrictInt], None] = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_CHAT_MESSAGES)
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT_CHARS)
    prefix_id: str | None = None
    priority: StrictInt = RETENTION_MAX_PRIORITY
    ttl: Union[StrictFloat, str, None] = None
    warm: StrictBool = True


async def list_prefixes(ingress: Any, http_request: Request) -> Response:
    try:
        ingress._check_admin_key(http_request)
        results = await ingress.replicas.broadcast("prefix_reports").results_async(timeout_s=ADMIN_TIMEOUT_S)
    except APIError as error:
        return api_error_response(error)
    reports = [report for result in results for report in result]
    return JSONResponse({"object": "list", "data": merge_reports(reports)})


async def pin_prefix(ingress: Any, http_request: Request) -> Response:
    try:
        ingress._check_admin_key(http_request)
        spec = await _read_spec(ingress, http_request)
        info = await ingress._replica_info()
        if not info.enable_prefix_caching:
            raise APIError("prefix caching is off on this server; nothing can be pinned", status=409)
        token_ids = await _prefix_token_ids(ingress, spec, info)
        ttl_s = None if spec.ttl is None else parse_ttl(spec.ttl, param="ttl")
        try:
            retention = Retention(priority=spec.priority, ttl_s=ttl_s)
        except ValueError as error:
            raise APIError(str(error), param="priority" if "priority" in str(error) else "ttl") from None
        keys = _page_keys(token_ids, info, spec.cache_salt)
        prefix_id = prefix_id_of(keys)
        label = _label(ingress, token_ids)
        pin = PinPrefix(tuple(keys), priority=retention.priority, ttl_s=retention.ttl_s, label=label,
                        pin_id=uuid.uuid4().hex)
        results = await ingress.replicas.broadcast("pin_prefix", pin).results_async(timeout_s=ADMIN_TIMEOUT_S)
        warmed = False
        if spec.warm and not any(result["num_pages_resident"] == len(keys) for result in results):
            try:
                await _warm(ingress, token_ids[: len(keys) * info.page_size], keys, spec.cache_salt, retention, info)
            except APIError:
                await _take_back(ingress, prefix_id, pin.pin_id)
                raise
            warmed = True
            results = await _counts_now(ingress, prefix_id, results)
    except APIError as error:
        return api_error_response(error)
    return JSONResponse({"prefix_id": prefix_id, "num_tokens": len(keys) * info.page_size,
                         "num_pages": len(keys), "priority": retention.priority, "ttl_s": retention.ttl_s,
                         "replicas": results, "warmed": warmed})


async def _counts_now(ingress: Any, prefix_id: str, results: list[dict]) -> list[dict]:
    """The pin's per-replica page counts asked again after its warm-up computed the prefix (the pin's own answers came
    before it: 0 pages resident); without an answer (a replica gone meanwhile) the pin's own answers stand."""
    try:
        reports = await ingress.replicas.broadcast("prefix_reports").results_async(timeout_s=ADMIN_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the pin took effect: report it, with the counts it gave
        logger.warning("pinned prefix %s: its page counts could not be asked again after the warm-up", prefix_id)
        return results
    now = {report.replica_id: report for result in reports for report in result if report.prefix_id == prefix_id}
    return [{**entry, "num_pages_resident": now[entry["replica_id"]].num_pages_resident,
             "num_pages_retained": now[entry["replica_id"]].num_pages_retained}
            if entry["replica_id"] in now else entry for entry in results]


async def unpin_prefix(ingress: Any, http_request: Request) -> Response:
    try:
        ingress._check_admin_key(http_request)
        spec = await _read_spec(ingress, http_request)
        if sum(value is not None for value in (spec.prefix_id, spec.prompt, spec.messages)) != 1:
            raise APIError("give exactly one of prefix_id, prompt or messages", param="prefix_id")
        prefix_id = spec.prefix_id
        if prefix_id is None:
            info = await ingress._replica_info()
            token_ids = await _prefix_token_ids(ingress, spec, info)
            prefix_id = prefix_id_of(_page_keys(token_ids, info, spec.cache_salt))
        results = await ingress.replicas.broadcast("unpin_prefix", prefix_id).results_async(timeout_s=ADMIN_TIMEOUT_S)
    except APIError as error:
        return api_error_response(error)
    if not any(results):
        return api_error_response(APIError(f"no retained prefix {prefix_id!r}", status=404, type="not_found_error",
                                           param="prefix_id"))
    return JSONResponse({"prefix_id": prefix_id, "num_replicas": sum(1 for result in results if result)})


async def _read_spec(ingress: Any, http_request: Request) -> PrefixSpec:
    """The body of a pin or unpin, read within ``--max-request-body-bytes`` as the /v1 routes read theirs."""
    body = await read_body(http_request, ingress.config.max_request_body_bytes)
    return parse_request(PrefixSpec, parse_json_body(body))


def merge_reports(reports: list[PrefixReport]) -> list[dict[str, Any]]:
    """One entry per prefix with its replicas' numbers side by side and summed, most hit first."""
    by_id: dict[str, dict[str, Any]] = {}
    for report in sorted(reports, key=lambda item: item.replica_id):
        entry = by_id.get(report.prefix_id)
        if entry is None:
            entry = by_id[report.prefix_id] = {
                "prefix_id": report.prefix_id, "source": report.source, "label": report.label,
                "priority": report.priority, "ttl_s": report.ttl_s, "num_pages": report.num_pages,
                "num_requests": 0, "num_hits": 0, "cached_tokens": 0, "replicas": [], "tiers": {}}
        if report.source == "admin":
            entry["source"] = "admin"
        entry["priority"] = max(entry["priority"], report.priority)
        for name in ("num_requests", "num_hits", "cached_tokens"):
            entry[name] += getattr(report, name)
        entry["replicas"].append({"replica_id": report.replica_id, "num_pages_resident": report.num_pages_resident,
                                  "num_pages_retained": report.num_pages_retained,
                                  "num_requests": report.num_requests, "num_hits": report.num_hits,
                                  "cached_tokens": report.cached_tokens, "idle_s": report.idle_s})
        for tier, num_pages, num_retained in report.tiers:
            # a shared tier answers every replica alike; replicas asked at slightly different moments: the most seen
            seen = entry["tiers"].get(tier)
            if seen is None or (num_pages, num_retained) > (seen["num_pages"], seen["num_pages_retained"]):
                entry["tiers"][tier] = {"num_pages": num_pages, "num_pages_retained": num_retained}
    return sorted(by_id.values(), key=lambda entry: (-entry["num_hits"], entry["prefix_id"]))


async def _prefix_token_ids(ingress: Any, spec: PrefixSpec, info: Any) -> list[int]:
    if (spec.prompt is None) == (spec.messages is None):
        raise APIError("give exactly one of prompt or messages", param="prompt")
    if isinstance(spec.prompt, list):
        if any(not 0 <= token < info.vocab_size for token in spec.prompt):
            raise APIError(f"token ids must be in [0, {info.vocab_size})", param="prompt")
        token_ids = list(spec.prompt)
    else:
        token_ids = await asyncio.get_running_loop().run_in_executor(ingress._tokenize_pool, _tokenize, ingress, spec)
    if len(token_ids) < info.page_size:
        raise APIError(f"the prefix has {len(token_ids)} tokens; only whole pages of {info.page_size} tokens are "
                       f"cached, so a prefix needs at least {info.page_size} tokens",
                       param="prompt" if spec.prompt is not None else "messages")
    if len(token_ids) >= info.max_model_len:
        raise APIError(f"the prefix has {len(token_ids)} tokens; this model serves at most {info.max_model_len}",
                       param="prompt" if spec.prompt is not None else "messages")
    return token_ids


def _tokenize(ingress: Any, spec: PrefixSpec) -> list[int]:
    if spec.prompt is not None:
        return ingress.tokenizer(spec.prompt).input_ids
    from cluster.protocol import chat_messages

    class _Messages:  # chat_messages reads .messages only
        messages = spec.messages

    return ingress._apply_chat_template(chat_messages(_Messages), add_generation_prompt=False)


def _page_keys(token_ids: list[int], info: Any, salt: str | None) -> list[bytes]:
    return compute_page_keys(token_ids, page_size=info.page_size, model_fingerprint=info.model_fingerprint,
                             salt=salt)


def _label(ingress: Any, token_ids: list[int]) -> str:
    try:
        return ingress.tokenizer.decode(token_ids[:64])[:MAX_LABEL_CHARS]
    except Exception:  # noqa: BLE001 - a label is only for listings
        return ""


async def _take_back(ingress: Any, prefix_id: str, pin_id: str) -> None:
    """Take back a pin that failed after it was broadcast: the caller is told it failed, so each replica puts the
    prefix back as it was before the call (pinned earlier: that pin, with its priority and TTL; otherwise not pinned).
    A pin or unpin of the same prefix that came after this one stands. Best effort: the caller's error is the one
    reported."""
    try:
        await ingress.replicas.broadcast("take_back_pin", prefix_id, pin_id).results_async(timeout_s=ADMIN_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - logged; the pin's own error goes to the caller
        logger.warning("could not take back the failed pin of prefix %s", prefix_id, exc_info=True)


async def _warm(ingress: Any, token_ids: list[int], keys: list[bytes], salt: str | None, retention: Retention,
                info: Any) -> None:
    """Compute the prefix on the replica the router picks (one generated token), so it is cached and pinned."""
    request = EngineRequest(request_id=uuid.uuid4().hex, prompt_token_ids=token_ids,
                            sampling=SamplingParams(max_tokens=1, temperature=0.0), cache_salt=salt,
                            page_keys=keys, retention=retention)
    stream = streaming(ingress.replicas, ingress.config.replica_transport).generate.remote(request)
    try:
        async for output in stream:
            if output.finished:
                break
    except InvalidRequestError as error:  # e.g. the prefix alone is more than the retention budget
        message = str(getattr(error, "cause", None) or error).strip().splitlines()
        raise APIError(f"the prefix is not pinned: the replica refused to compute it: "
                       f"{message[-1] if message else 'invalid request'}") from None
    except Exception as error:  # noqa: BLE001 - reported; the caller takes the pin back
        raise APIError(f"the prefix is not pinned: computing it failed: {type(error).__name__}", status=500,
                       type="server_error") from None
