"""Reading a request body within its bound and answering an ``APIError``: the HTTP plumbing the ingress's routes
(cluster/openai_api.py) and its admin routes (cluster/admin_api.py) share."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from cluster.protocol import APIError

BODY_IDLE_TIMEOUT_S = 30.0
"""Longest wait for the next piece of a request body: a client that stops sending gets a 408 and its slot back (the
ingress takes a bounded number of requests at once; bodies that never end would hold them all)."""
BODY_TOTAL_TIMEOUT_S = 120.0
"""Longest time to read a whole body, however it trickles in (8 MiB takes under a second on any real link)."""


def api_error_response(error: APIError) -> JSONResponse:
    headers = error.headers()
    if error.status == 408:  # the body was not read to its end, so the connection cannot carry another request
        headers["Connection"] = "close"
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, read no further than ``max_bytes`` (APIError 413 beyond: Content-Length is trusted to refuse
    early, and the bytes actually read are counted too) and within BODY_IDLE_TIMEOUT_S between pieces and
    BODY_TOTAL_TIMEOUT_S in all (APIError 408)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BODY_TOTAL_TIMEOUT_S
    pieces = request.stream()
    chunks = []
    size = 0
    while True:
        timeout_s = min(BODY_IDLE_TIMEOUT_S, deadline - loop.time())
        try:
            chunk = await asyncio.wait_for(pieces.__anext__(), max(timeout_s, 0.0))
        except StopAsyncIteration:
            return b"".join(chunks)
        except asyncio.TimeoutError:
            raise APIError(f"the request body did not arrive in time ({size} bytes in; at most "
                           f"{BODY_IDLE_TIMEOUT_S:g} s between pieces and {BODY_TOTAL_TIMEOUT_S:g} s in all)",
                           status=408, code="body_timeout") from None
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)


def _too_large(size: int, max_bytes: int) -> APIError:
    return APIError(f"the request body has more than {max_bytes} bytes ({size} seen); send a shorter prompt",
                    status=413, code="request_too_large")
