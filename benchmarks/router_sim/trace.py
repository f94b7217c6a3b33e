"""Trace input: replay an exact request sequence (e.g. the one a real ``prefixserve bench`` run sent) in the simulator.

A trace is JSONL, one request per line::

    {"request_id": "s3t1", "session": 3, "turn": 1, "arrival_s": 1.25, "prompt_len": 1300, "output_len": 16,
     "page_keys": ["9f0c...", ...], "min_gap_s": 0.0}

- ``page_keys``: hex keys of the prompt's full pages (``prompt_len // page_size`` of them), chained: equal keys mean
  equal prefixes. :func:`token_page_keys` makes them from token ids (any chained hash works; the simulator only
  compares keys).
- ``session`` / ``turn``: turns of one session are sent one after the other, each after the previous one finished
  (a multi-turn chat resends the conversation so far); turn 0 of a session starts at its ``arrival_s``.
- ``arrival_s``: seconds after the start. Two ways to use it (:func:`load_trace`):
    ``timed``   every request is sent at its own ``arrival_s`` (later turns: not before the previous turn finished);
                for a trace recorded from a real run this replays the real send times.
    ``closed``  only turn 0's ``arrival_s`` counts; a client limit (``Simulation(..., concurrency=C)``) holds requests
                while C are in flight, as ``prefixserve bench --concurrency C`` does; a later turn is sent when the
                previous one finished and at least ``min_gap_s`` after the previous one was sent.

Output pages are private to a request (their keys are derived from the request id): the bench client resends stand-in
answer tokens, so nothing after a request's prompt is ever reused, as in the real run.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Iterable, Sequence

from benchmarks.router_sim.workloads import SimRequest, Workload

MODES = ("timed", "closed")
MAX_TRACE_LINE_BYTES = 1 << 22


def token_page_keys(token_ids: Sequence[int], page_size: int) -> list[str]:
    """Chained hex keys of the full pages of ``token_ids`` (key i covers tokens [0, (i + 1) * page_size))."""
    keys: list[str] = []
    parent = b""
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = ",".join(str(int(token)) for token in token_ids[start:start + page_size]).encode()
        parent = hashlib.blake2b(parent + b"|" + page, digest_size=16).digest()
        keys.append(parent.hex())
    return keys


def trace_row(request_id: str, session: int, turn: int, arrival_s: float, token_ids: Sequence[int], output_len: int,
              page_size: int, min_gap_s: float = 0.0) -> dict:
    """One trace line for a prompt given as token ids."""
    return {"request_id": str(request_id), "session": int(session), "turn": int(turn), "arrival_s": float(arrival_s),
            "prompt_len": len(token_ids), "output_len": int(output_len),
            "page_keys": token_page_keys(token_ids, page_size), "min_gap_s": float(min_gap_s)}


def write_trace(path: str | Path, rows: Iterable[dict]) -> None:
    Path(path).write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))


def read_trace(path: str | Path) -> list[dict]:
    """The rows of a trace file, validated; ValueError names the line of the first bad row."""
    rows = []
    with Path(path).open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if len(raw) > MAX_TRACE_LINE_BYTES:
                raise ValueError(f"{path}:{number}: line longer than {MAX_TRACE_LINE_BYTES} bytes")
            if raw.strip():
                rows.append(validate_row(json.loads(raw), f"{path}:{number}"))
    return rows


def validate_row(row: dict, where: str = "row") -> dict:
    try:
        clean = {"request_id": str(row["request_id"]), "session": int(row.get("session", -1)),
                 "turn": int(row.get("turn", 0)), "arrival_s": float(row["arrival_s"]),
                 "prompt_len": int(row["prompt_len"]), "output_len": int(row["output_len"]),
                 "page_keys": [str(key) for key in row.get("page_keys", [])],
                 "min_gap_s": float(row.get("min_gap_s", 0.0))}
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where}: not a trace row ({error!r})") from None
    if not (math.isfinite(clean["arrival_s"]) and clean["arrival_s"] >= 0 and clean["prompt_len"] >= 1
            and clean["output_len"] >= 1 and clean["min_gap_s"] >= 0 and clean["turn"] >= 0):
        raise ValueError(f"{where}: arrival_s and min_gap_s must be >= 0, lengths >= 1")
    return clean


def load_trace(rows: Sequence[dict], page_size: int, *, mode: str = "timed", num_pages_per_replica: int = 1024,
               name: str = "trace") -> Workload:
    """A :class:`Workload` replaying ``rows`` (see the module docstring for ``mode``)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    rows = [validate_row(row, f"row {number}") for number, row in enumerate(rows)]
    sessions: dict = {}
    for number, row in enumerate(rows):
        session = row["session"] if row["session"] >= 0 else f"single-{number}"
        sessions.setdefault(session, []).append(row)
    firsts, in_order = [], []
    for turns in sessions.values():
        turns.sort(key=lambda row: row["turn"])
        previous = None
        for row in turns:
            num_full = row["prompt_len"] // page_size
            keys = tuple(key.encode() for key in row["page_keys"])  # the router's page keys are bytes
            if len(keys) != num_full:
                raise ValueError(f"request {row['request_id']}: {len(keys)} page keys for a {row['prompt_len']}-token "
                                 f"prompt with {page_size}-token pages (want {num_full})")
            total_full = (row["prompt_len"] + row["output_len"]) // page_size
            private = tuple(f"{row['request_id']}/out{i}".encode() for i in range(num_full, total_full))
            request = SimRequest(row["request_id"], row["arrival_s"], row["prompt_len"], row["output_len"], keys,
                                 keys + private, first_turn=previous is None, min_gap_s=row["min_gap_s"],
                                 not_before_s=row["arrival_s"] if mode == "timed" else 0.0)
            if previous is None:
                firsts.append(request)
            else:
                request.arrival_s = 0.0  # think time after the previous turn (the bench client sends at once)
                previous.next_turn = request
            previous = request
            in_order.append((row["arrival_s"], number, request))
    mark_ideal([request for _, _, request in sorted(in_order, key=lambda item: item[:2])], page_size)
    firsts.sort(key=lambda request: request.arrival_s)
    return Workload(name, firsts, num_pages_per_replica, f"trace of {len(rows)} requests ({mode})")


def mark_ideal(requests: Sequence[SimRequest], page_size: int) -> None:
    """``ideal_cached_pages`` in the given order: the leading prompt pages some earlier request already had."""
    seen: set = set()
    for request in requests:
        reusable = request.page_keys[: (request.prompt_len - 1) // page_size]
        number = 0
        for key in reusable:
            if key not in seen:
                break
            number += 1
        request.ideal_cached_pages = number
        seen.update(request.final_keys)
