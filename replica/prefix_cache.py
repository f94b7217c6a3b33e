"""Prefix cache: page key -> page id for full pages whose KV is computed, with the token ids each page holds.

A page is in the cache from ``insert`` until ``remove`` (called when the pool reuses it for other tokens, or on reset).
Whether a cached page is pinned (in use by a running request or being copied) is the pool's reference count; the cache
only answers "which page holds this key". ``match`` walks the chain of keys from the first page and stops at the first
miss, so a hit is always a whole prefix.
"""

from __future__ import annotations

from typing import Sequence

from common.page_keys import PageKey


class PrefixCache:
    def __init__(self) -> None:
        self.key_to_page: dict[PageKey, int] = {}
        self.page_to_key: dict[int, PageKey] = {}
        self.page_to_token_ids: dict[int, tuple[int, ...]] = {}

    @property
    def num_pages(self) -> int:
        return len(self.key_to_page)

    def match(self, page_keys: Sequence[PageKey]) -> list[int]:
        """Page ids of the longest run of leading keys present in the cache."""
        page_ids = []
        for key in page_keys:
            page_id = self.key_to_page.get(key)
            if page_id is None:
                break
            page_ids.append(page_id)
        return page_ids

    def lookup(self, key: PageKey) -> int | None:
        return self.key_to_page.get(key)

    def key_of(self, page_id: int) -> PageKey | None:
        return self.page_to_key.get(page_id)

    enabled = True
    """False for ``NullPrefixCache`` (prefix caching off): callers skip hashing keys they would never match."""

    def insert(self, key: PageKey, page_id: int, token_ids: Sequence[int]) -> bool:
        """Record that ``page_id`` holds the KV of ``key``; True when recorded. Neither may already be cached."""
        if key in self.key_to_page:
            raise KeyError("key already cached; use lookup() first and share that page")
        if page_id in self.page_to_key:
            raise KeyError(f"page {page_id} already holds another key")
        self.key_to_page[key] = page_id
        self.page_to_key[page_id] = key
        self.page_to_token_ids[page_id] = tuple(token_ids)
        return True

    def remove(self, page_id: int) -> PageKey | None:
        """Forget what ``page_id`` holds; returns its key, or None if it held none."""
        key = self.page_to_key.pop(page_id, None)
        if key is not None:
            del self.key_to_page[key]
            del self.page_to_token_ids[page_id]
        return key

    def clear(self) -> list[PageKey]:
        keys = list(self.key_to_page)
        self.key_to_page.clear()
        self.page_to_key.clear()
        self.page_to_token_ids.clear()
        return keys

    def check_integrity(self) -> None:
        if len(self.key_to_page) != len(self.page_to_key) or len(self.page_to_key) != len(self.page_to_token_ids):
            raise AssertionError("prefix cache maps differ in size")
        for key, page_id in self.key_to_page.items():
            if self.page_to_key.get(page_id) != key:
                raise AssertionError(f"page {page_id} maps back to another key")


class NullPrefixCache(PrefixCache):
    """The cache when prefix caching is off: it records nothing, so nothing is ever matched and every released page is
    a plain free page. The scheduler and engine run the same code either way."""

    enabled = False

    def insert(self, key: PageKey, page_id: int, token_ids: Sequence[int]) -> bool:
        return False
