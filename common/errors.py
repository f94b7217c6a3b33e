"""Errors that cross a process boundary (replica -> ingress), so the ingress classifies them by type, not by name.

    InvalidRequestError   the request can never be served as given        -> 400
    ReplicaUnavailableError  no replica can take it now (retry later)     -> 503
    EngineDeadError       the engine stopped while the request was in it  -> 500 / an SSE error event
    ReplicaFullError      the replica holds all the requests it takes     -> 429
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request can never be served as given (the HTTP layer answers 400 with this message)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown or a fatal error); the request could not complete."""


class ReplicaFullError(RuntimeError):
    """The replica already holds as many requests as it takes (``--max-num-seqs`` + ``--max-queued-requests``,
    counting those of request lanes, which Serve's own limit does not see); the client may retry shortly."""


class ReplicaUnavailableError(RuntimeError):
    """No replica can take the request now (all gone, overloaded, or restarting); the client may retry."""
