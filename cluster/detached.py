"""Tasks that outlive the Serve request that started them.

Ray Serve links every replica call a request makes to that request, through its request context (a contextvar that
``asyncio`` copies into each task created from the request's code), and cancels those calls when the request is
cancelled: a client hanging up. A call that serves many requests, such as an output channel to a replica or a
hot-prefix copy, must not end with the one request that happened to start it (it did: one client's disconnect failed
the other requests bound to the same channel with ``OutputChannelClosed``). Such tasks start in a fresh, empty
context instead, so the calls they make belong to no request.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any, Coroutine


def create_detached_task(coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """``coro`` as a task on the running loop, in an empty context (see the module docstring). The task copies the
    context it is created in, so it is created inside an empty one (``create_task``'s ``context`` argument needs
    Python 3.11; this works on 3.10 too)."""
    return contextvars.Context().run(asyncio.get_running_loop().create_task, coro)
