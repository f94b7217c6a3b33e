"""Calls a process keeps open to a replica while that replica serves other requests (the ingress's output channels,
cluster/output_channels.py, which keeps this count). Serve's queue length counts each as an ongoing request, and
tells the router such a call completed as soon as it was sent; the router (router/ray_router.py) takes them back out
of a replica's load.

A module of its own, read through the module at call time: Serve may ship the router class by value, with its own
copy of its module's globals, so a counter kept there would not be the one the ingress changes."""

from __future__ import annotations

import collections

OPEN: collections.Counter[str] = collections.Counter()
"""Replica id -> calls of this process open to it."""


def opened(replica_id: str) -> None:
    OPEN[replica_id] += 1


def closed(replica_id: str) -> None:
    OPEN[replica_id] -= 1
    if OPEN[replica_id] <= 0:
        del OPEN[replica_id]
