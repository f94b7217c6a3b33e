"""Reading a request body within its bound and answering an ``APIError``: the HTTP plumbing the ingress's routes
(cluster/openai_api.py) and its admin routes (cluster/admin_api.py) share."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from cluster.protocol import APIError


def api_error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, read no further than ``max_bytes`` (APIError 413 beyond: Content-Length is trusted to refuse
    early, and the bytes actually read are counted too)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int) -> APIError:
    return APIError(f"the request body has more than {max_bytes} bytes ({size} seen); send a shorter prompt",
                    status=413, code="request_too_large")
