"""Retained prefixes of one replica: admin pins and request retentions, with per-prefix stats (no torch, no Ray).

A prefix is the chain of page keys of a prompt's leading full pages; it is named by the hex of its last key (which
depends on every page before it, the salt and the model, so the name says the whole chain)::

    prompt pages  | k0 | k1 | k2 | k3 | ...
    pinned prefix | k0 | k1 | k2 |            prefix_id = k2.hex()[:32]

An admin pin is remembered here before its pages exist: when a page whose key belongs to a pin enters the prefix
cache, the KV manager gives it the pin's retention (``pin_for``). Request retentions (the extension field or
``cache_control``) are applied to the request's own pages by the scheduler; they are listed here too (bounded, the
least recently used go first) so the admin endpoint shows what is being retained and how often it is hit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from common.page_keys import PageKey, prefix_id_of

MAX_REQUEST_ENTRIES = 256
"""Request retentions listed per replica (admin pins are not bounded here: each is an explicit operator action)."""
MAX_LABEL_CHARS = 80


@dataclass
class RetainedPrefix:
    prefix_id: str
    keys: tuple[PageKey, ...]
    priority: int
    ttl_s: float | None
    source: str
    """"admin" (pinned through the admin endpoint) or "request" (a request's retention field / cache_control)."""
    label: str
    created_at: float
    last_used_at: float
    num_requests: int = 0
    """Requests here whose prompt started with the whole prefix."""
    num_hits: int = 0
    """... of which found the whole prefix in this replica's cache."""
    cached_tokens: int = 0
    """Prompt tokens those requests reused from this prefix here."""

    def expired(self, now: float) -> bool:
        return self.ttl_s is not None and now >= self.last_used_at + self.ttl_s


class RetentionRegistry:
    def __init__(self, page_size: int, clock: Callable[[], float]) -> None:
        self.page_size = page_size
        self.clock = clock
        self.prefix_id_to_entry: dict[str, RetainedPrefix] = {}
        self._last_key_to_prefix_id: dict[PageKey, str] = {}
        self._key_to_pin: dict[PageKey, tuple[int, float | None]] = {}
        """Keys of admin pins -> (priority, ttl_s): the retention a page gets when it enters the cache."""

    def pin_for(self, key: PageKey) -> tuple[int, float | None] | None:
        return self._key_to_pin.get(key)

    def add(self, keys: Sequence[PageKey], *, priority: int, ttl_s: float | None, source: str,
            label: str = "") -> RetainedPrefix:
        """Record a retained prefix (an existing entry with the same keys is refreshed and keeps the higher
        priority; an admin pin replaces a request entry's source)."""
        if not keys:
            raise ValueError("a retained prefix needs at least one full page")
        now = self.clock()
        prefix_id = prefix_id_of(keys)
        entry = self.prefix_id_to_entry.get(prefix_id)
        if entry is None:
            entry = RetainedPrefix(prefix_id, tuple(keys), priority, ttl_s, source, label[:MAX_LABEL_CHARS], now, now)
            self.prefix_id_to_entry[prefix_id] = entry
            self._last_key_to_prefix_id[keys[-1]] = prefix_id
        else:
            entry.last_used_at = now
            if source == "admin" or entry.source == source:
                entry.priority, entry.ttl_s, entry.source = priority, ttl_s, source
            else:
                entry.priority = max(entry.priority, priority)
            entry.label = entry.label or label[:MAX_LABEL_CHARS]
        if source == "admin":
            self._rebuild_pins()
        else:
            self._bound_request_entries()
        return entry

    def remove(self, prefix_id: str) -> RetainedPrefix | None:
        entry = self.prefix_id_to_entry.pop(prefix_id, None)
        if entry is not None:
            self._last_key_to_prefix_id.pop(entry.keys[-1], None)
            self._rebuild_pins()
        return entry

    def set_retention(self, prefix_id: str, priority: int, ttl_s: float | None, source: str) -> RetainedPrefix | None:
        """Give a listed prefix this retention and source as they are (a pin taken back: no max with the current
        one, stats kept); None when it is not listed."""
        entry = self.prefix_id_to_entry.get(prefix_id)
        if entry is not None:
            entry.priority, entry.ttl_s, entry.source = priority, ttl_s, source
            self._rebuild_pins()
        return entry

    def keys_still_listed(self, excluding: RetainedPrefix | None = None) -> set[PageKey]:
        """Keys of every listed entry but ``excluding`` (their pages keep retention when a prefix sharing them ends)."""
        return {key for entry in self.prefix_id_to_entry.values() if entry is not excluding for key in entry.keys}

    def observe_request(self, page_keys: Sequence[PageKey], num_cached_pages: int) -> None:
        """Count a request against every listed prefix its prompt starts with (cheap: one dict probe per page)."""
        if not self._last_key_to_prefix_id:
            return
        now = self.clock()
        for index, key in enumerate(page_keys):
            prefix_id = self._last_key_to_prefix_id.get(key)
            if prefix_id is None:
                continue
            entry = self.prefix_id_to_entry[prefix_id]
            entry.num_requests += 1
            entry.last_used_at = now
            if num_cached_pages > index:
                entry.num_hits += 1
                entry.cached_tokens += (index + 1) * self.page_size

    def entries(self) -> list[RetainedPrefix]:
        """Every listed prefix (request entries whose TTL passed are dropped first)."""
        now = self.clock()
        for entry in list(self.prefix_id_to_entry.values()):
            if entry.source == "request" and entry.expired(now):
                self.remove(entry.prefix_id)
        return list(self.prefix_id_to_entry.values())

    def clear_requests(self) -> None:
        for entry in list(self.prefix_id_to_entry.values()):
            if entry.source == "request":
                self.remove(entry.prefix_id)

    def _rebuild_pins(self) -> None:
        self._key_to_pin = {}
        for entry in self.prefix_id_to_entry.values():
            if entry.source != "admin":
                continue
            for key in entry.keys:
                current = self._key_to_pin.get(key)
                if current is None or entry.priority > current[0]:
                    self._key_to_pin[key] = (entry.priority, entry.ttl_s)

    def _bound_request_entries(self) -> None:
        requests = [entry for entry in self.prefix_id_to_entry.values() if entry.source == "request"]
        if len(requests) <= MAX_REQUEST_ENTRIES:
            return
        requests.sort(key=lambda entry: entry.last_used_at)
        for entry in requests[: len(requests) - MAX_REQUEST_ENTRIES]:
            self.remove(entry.prefix_id)
