"""Streaming one request to an OpenAI-compatible server and timing it.

:func:`stream_request` POSTs a streamed request and folds every SSE chunk into a :class:`StreamResult` with
:func:`absorb_chunk`: time to the first token, the gaps between tokens, the text, token ids, usage and finish reason.
Also here: the ``httpx`` client sized for a run (:func:`make_http_client`) and model discovery through ``/v1/models``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from bench.config import ClientConfig

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass
class StreamResult:
    """What one streamed request returned, timed from the moment it was sent."""

    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    num_token_chunks: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    http_status: int | None = None
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and self.ttft_s is not None


def parse_sse_data(line: str) -> str | None:
    """The payload of an SSE ``data:`` line, or None for other lines (comments, ``event:``, blank)."""
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


def choice_text(choice: dict[str, Any]) -> str:
    """The new text of a streamed choice (completions ``text`` or chat ``delta.content``)."""
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def choice_token_ids(choice: dict[str, Any]) -> list[int]:
    """Token ids a server attached to a streamed choice (vLLM's ``return_token_ids``), else []."""
    ids = choice.get("token_ids")
    if ids is None:
        ids = (choice.get("delta") or {}).get("token_ids")
    return list(ids or [])


def is_token_chunk(choice: dict[str, Any]) -> bool:
    """True when a streamed choice stands for generated tokens.

    Text or token ids count; so does an empty unfinished piece (a token whose bytes the detokenizer holds back).
    A chat chunk that only announces the role, and a bare closing chunk with only a finish reason, do not.
    """
    if choice_text(choice) or choice_token_ids(choice):
        return True
    if choice.get("finish_reason") is not None:
        return False
    delta = choice.get("delta")
    return not (delta is not None and "role" in delta)


def absorb_chunk(
    result: StreamResult, chunk: dict[str, Any], elapsed_s: float, last_token_s: float | None
) -> float | None:
    """Fold one parsed chunk received ``elapsed_s`` after sending into ``result``; return the new last-token time."""
    if chunk.get("error"):
        result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
        return last_token_s
    if chunk.get("usage"):
        result.usage = chunk["usage"]
    for choice in chunk.get("choices") or []:
        result.text += choice_text(choice)
        result.token_ids.extend(choice_token_ids(choice))
        if choice.get("finish_reason") is not None:
            result.finish_reason = choice["finish_reason"]
        if not is_token_chunk(choice):
            continue
        if result.ttft_s is None:
            result.ttft_s = elapsed_s
        elif last_token_s is not None:
            result.itl_s.append(elapsed_s - last_token_s)
        result.num_token_chunks += 1
        last_token_s = elapsed_s
    return last_token_s


async def stream_request(client: Any, url: str, payload: dict[str, Any], headers: dict[str, str]) -> StreamResult:
    """POST ``payload`` with streaming and time every chunk. Never raises: failures land in ``result.error``."""
    result = StreamResult()
    start = time.perf_counter()
    last_token_s: float | None = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            result.http_status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                data = parse_sse_data(line)
                if data is None or not data:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                last_token_s = absorb_chunk(result, chunk, time.perf_counter() - start, last_token_s)
                if result.error is not None:
                    break
    except Exception as exc:  # noqa: BLE001 - any failure of one request is recorded, not raised
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.e2e_s = time.perf_counter() - start
    if result.error is None and result.ttft_s is None:
        result.error = "the stream ended without any token"
    return result


def is_loopback(url: str) -> bool:
    """True for a URL on this machine (no proxy from the environment should be used for it)."""
    return (urlparse(url).hostname or "") in LOOPBACK_HOSTS


def make_http_client(client_config: ClientConfig, concurrency: int) -> Any:
    """An ``httpx.AsyncClient`` sized for ``concurrency`` streams (environment proxies ignored for loopback)."""
    import httpx

    max_connections = None if concurrency == 0 else max(concurrency, 1) + 2
    return httpx.AsyncClient(
        timeout=httpx.Timeout(client_config.timeout_s, connect=min(30.0, client_config.timeout_s)),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        trust_env=not is_loopback(client_config.base_url),
    )


async def discover_model(client: Any, client_config: ClientConfig) -> str:
    """The first model id that ``GET /v1/models`` lists (raises RuntimeError with the remedy when it cannot)."""
    try:
        response = await client.get(client_config.api_root + "/v1/models", headers=client_config.headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(
            f"could not list models at {client_config.api_root}/v1/models ({type(exc).__name__}: {exc}); "
            f"is the server up? pass --model to skip discovery"
        ) from exc
