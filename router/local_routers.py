"""The prefix-aware routers of this process, by deployment, for callers that route requests they send themselves
(the ingress's request lanes, cluster/request_lanes.py).

A module of its own, read at call time, for the reason router/long_calls.py gives: Serve may ship the router class by
value, with its own copy of its module's globals."""

from __future__ import annotations

import weakref
from typing import Any

_ROUTERS: dict[tuple[str, str], weakref.ref] = {}


def register(app_name: str, deployment_name: str, router: Any) -> None:
    """The router made last for a deployment in this process is its router (a handle and the handles its
    ``options()`` make share one router, so an ingress has one per deployment it calls)."""
    _ROUTERS[(app_name, deployment_name)] = weakref.ref(router)


def find(app_name: str, deployment_name: str) -> Any:
    """The deployment's router in this process, or None."""
    ref = _ROUTERS.get((app_name, deployment_name))
    return ref() if ref is not None else None
