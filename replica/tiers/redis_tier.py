"""The host-memory tier: pages in a Redis server shared by every replica that points at it.

Layout in Redis (``prefix`` defaults to ``"prefixserve:"``)::

    {prefix}format                  -> b"1"   the page-key format version; claimed by the first replica (SET NX)
    {prefix}{dtype}:{storage id}    -> blob   one page: msgpack header + sealed KV bytes (see ``codec``, ``seal``)

Access: give the server a password (``redis://:PASSWORD@host:port/db``, or a user: ``redis://USER:PASSWORD@...``) and,
off the machine, TLS (``rediss://host:port/db?ssl_ca_certs=/path/ca.pem``; ``ssl_certfile`` / ``ssl_keyfile`` for client
certificates). Page names are keyed digests and the KV is encrypted under the cluster key, so a reader of the server
learns neither prompts nor which prompts were served; one who can write can only delete or plant entries that then
fail authentication (a miss, counted in ``discarded_corrupt``).

Eviction order: Redis' own. Run the server with a memory bound and an LRU policy, e.g.
``redis-server --maxmemory 4gb --maxmemory-policy allkeys-lru`` (the tier warns once if the policy would refuse
writes instead). The format marker may be evicted like any key; that is harmless because every page header carries
the key format version too, and the marker is claimed again on the next (re)connection.

Faults: every call uses short socket timeouts (0.5 s) and no client-side retries. When Redis is unreachable the tier
logs one warning, counts an error, and answers misses (lookup 0, load [], store drops) without touching the network
until a backoff passes; then one call probes, and on success the tier is back (one more log line).
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from typing import Callable, Sequence, TypeVar

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.page_format import PageFormat
from common.page_keys import PageKey
from common.types import CacheSource
from replica.tiers.base import (
    QueuedWriteTier,
    StatsRecorder,
    StoredPage,
    WarningThrottle,
    check_load_args,
)
from replica.tiers.circuit import BackoffPolicy, CircuitBreaker
from replica.tiers.codec import RejectedEntry, decode_blob, encode_blob, new_page_tensors, sealed_size
from replica.tiers.seal import TierKey
from replica.tiers.writer import BackgroundWriter

logger = logging.getLogger(__name__)

T = TypeVar("T")

_UNREACHABLE_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
_EVICTING_POLICIES = {"allkeys-lru", "allkeys-lfu", "allkeys-random"}
LOAD_BATCH_BYTES = 32 << 20
"""At most this many sealed bytes per MGET (bounds the reply a load holds at once)."""


class RedisTier(QueuedWriteTier):
    """Shared host-memory KV tier in Redis (see the module docstring for layout, eviction and faults).

    Mutates: only keys under ``key_prefix`` (page entries it writes or rejects, and the format marker).
    Raises: ValueError for a malformed ``url`` or bad arguments; nothing because of Redis' state.

    ``tier_key`` seals and names the pages (every replica sharing the server must hold the same key to share pages;
    one built without a key generates its own: private to this instance).
    """

    source = CacheSource.HOST

    def __init__(
        self,
        url: str,
        page_format: PageFormat,
        *,
        key_prefix: str = "prefixserve:",
        tier_key: TierKey | None = None,
        queue_size: int = 256,
        socket_timeout_s: float = 0.5,
        backoff: BackoffPolicy = BackoffPolicy(),
        load_batch_pages: int = 32,
        write_batch_pages: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if load_batch_pages < 1:
            raise ValueError(f"load_batch_pages must be at least 1, got {load_batch_pages}")
        self._page_format = page_format
        self._tier_key = tier_key or TierKey.generate()
        self._key_prefix = key_prefix
        self._marker_key = f"{key_prefix}format"
        self._page_key_prefix = f"{key_prefix}{page_format.dtype}:"
        self._load_batch_pages = max(1, min(load_batch_pages, LOAD_BATCH_BYTES // sealed_size(page_format)))
        self._url = url
        self._where = describe_url(url)
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            socket_read_size=1 << 20,  # pages are ~1 MiB: read them in few large chunks, not 64 KiB ones
        )
        self._breaker = CircuitBreaker(backoff, clock)
        self._needs_handshake = True
        self._refused = False
        self._closed = False
        self._stats = StatsRecorder()
        self._throttle = WarningThrottle()
        self._writer = BackgroundWriter(
            name="redis-tier",
            write_pages=self._write_pages,
            on_failure=self._count_dropped,
            capacity=queue_size,
            max_batch_pages=write_batch_pages,
        )
        self._run(lambda client: client.ping(), default=None)  # connect now: format conflicts show at start-up

    # ---- KVTier -----------------------------------------------------------------------------------------------

    @property
    def page_format(self) -> PageFormat:
        return self._page_format

    @property
    def tier_key(self) -> TierKey:
        """The key that names and seals this tier's pages."""
        return self._tier_key

    @property
    def available(self) -> bool:
        return not self._closed and not self._refused and self._breaker.available

    @property
    def url(self) -> str:
        return self._url

    @property
    def refused(self) -> bool:
        """True if the server holds another key format version: the tier is disabled for good."""
        return self._refused

    def lookup(self, keys: Sequence[PageKey]) -> int:
        """One pipelined EXISTS per key, in one round trip; 0 while Redis is unreachable."""
        if not keys:
            return 0

        def probe(client: redis.Redis) -> list[int]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.redis_key(key))
            return pipe.execute()

        return count_leading_true(self._run(probe, default=[]))

    def load(self, keys: Sequence[PageKey], token_ids_per_page: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """MGET in batches of ``load_batch_pages`` (one round trip for a usual prefix); verify each page in order,
        decrypting it straight into one tensor of the load's pages; stop at the first miss."""
        check_load_args(self._page_format, keys, token_ids_per_page)
        start_time = time.perf_counter()
        loaded: list[torch.Tensor] = []
        pages = new_page_tensors(self._page_format, len(keys)) if keys else None
        try:
            for batch_start in range(0, len(keys), self._load_batch_pages):
                batch_keys = keys[batch_start : batch_start + self._load_batch_pages]
                batch_tokens = token_ids_per_page[batch_start : batch_start + self._load_batch_pages]
                batch_loaded = self._load_batch(batch_keys, batch_tokens, pages[batch_start:])
                loaded.extend(batch_loaded)
                if len(batch_loaded) < len(batch_keys):
                    break
        finally:
            self._record_load(len(loaded), start_time)
        return loaded

    def close(self, timeout: float | None = 5.0) -> None:
        if self._closed:
            return
        self._writer.close(timeout)
        self._closed = True
        self._client.close()

    # ---- internals ----------------------------------------------------------------------------------------------

    def redis_key(self, key: PageKey) -> str:
        """The Redis key of page ``key`` in this tier's namespace."""
        return self._page_key_prefix + self._tier_key.storage_id(key)

    def _load_batch(self, keys: Sequence[PageKey], token_ids_per_page: Sequence[Sequence[int]],
                    out: torch.Tensor) -> list[torch.Tensor]:
        values = self._run(lambda client: client.mget([self.redis_key(key) for key in keys]), default=None)
        loaded: list[torch.Tensor] = []
        for index, (key, token_ids, value) in enumerate(zip(keys, token_ids_per_page, values or ())):
            if value is None:
                break
            try:
                loaded.append(decode_blob(value, self._page_format, self._tier_key, key, token_ids, out[index]))
            except RejectedEntry as exc:
                self._discard(key, str(exc))
                break
        return loaded

    def _discard(self, key: PageKey, reason: str) -> None:
        self._stats.add(discarded_corrupt=1)
        if self._throttle.should_warn("discard"):
            logger.warning("Redis KV tier at %s: discarding page %s: %s", self._where, self.redis_key(key), reason)
        self._run(lambda client: client.delete(self.redis_key(key)), default=0)

    def _write_pages(self, pages: list[StoredPage]) -> None:
        """Writer thread: one pipelined SET per page, one round trip for the batch."""
        start_time = time.perf_counter()
        entries = [(self.redis_key(page.key), encode_blob(page, self._tier_key)) for page in pages]

        def write(client: redis.Redis) -> bool:
            pipe = client.pipeline(transaction=False)
            for redis_key, blob in entries:
                pipe.set(redis_key, blob)
            pipe.execute()
            return True

        if self._run(write, default=False):
            self._stats.add(
                pages_stored=len(pages),
                bytes_stored=len(pages) * self._page_format.page_num_bytes,
                store_seconds=time.perf_counter() - start_time,
            )
        else:
            self._count_dropped(pages)
            self._stats.add(store_seconds=time.perf_counter() - start_time)

    def _run(self, operation: Callable[[redis.Redis], T], default: T) -> T:
        """``operation(client)``, or ``default`` when the tier is closed, refused, backing off, or the call fails."""
        if self._closed or self._refused or not self._breaker.allow():
            return default
        try:
            if self._needs_handshake:
                self._handshake()
                if self._refused:
                    return default
            result = operation(self._client)
        except _UNREACHABLE_ERRORS as exc:
            self._note_unreachable(exc)
            return default
        except redis.RedisError as exc:
            self._stats.add(errors=1)
            if self._throttle.should_warn("command"):
                logger.warning("Redis KV tier at %s: command failed: %s: %s", self._where, type(exc).__name__, exc)
            return default
        if self._breaker.record_success():
            logger.warning("Redis KV tier at %s is reachable again", self._where)
        return result

    def _note_unreachable(self, exc: BaseException) -> None:
        self._stats.add(errors=1)
        self._needs_handshake = True
        if self._breaker.record_failure():
            hint = ""
            if isinstance(exc, redis.AuthenticationError) or "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
                hint = " (authentication failed: put the password in --redis-url, redis://:PASSWORD@host:port/db)"
            logger.warning(
                "Redis KV tier at %s is unreachable (%s: %s)%s; answering misses and dropping writes until it is back",
                self._where,
                type(exc).__name__,
                exc,
                hint,
            )

    def _handshake(self) -> None:
        """Claim or check the key-format marker; warn if Redis would refuse writes when full."""
        version = str(self._page_format.key_format_version).encode()
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._marker_key, version, nx=True)
        pipe.get(self._marker_key)
        _, found = pipe.execute()
        if found != version:
            self._refused = True
            logger.error(
                "Redis KV tier at %s REFUSED: it holds page-key format version %r under %r, this replica uses %r. "
                "The tier is disabled. Point --redis-url at another server or database, use another key prefix, "
                "or delete %r once no replica of the old version is running.",
                self._where,
                found,
                self._marker_key,
                version,
                self._marker_key,
            )
            return
        self._warn_if_unbounded()
        self._needs_handshake = False

    def _warn_if_unbounded(self) -> None:
        try:
            config = self._client.config_get("maxmemory*")
        except redis.ResponseError:  # CONFIG may be disabled on managed servers
            return
        found = {as_text(name): as_text(value) for name, value in config.items()}
        maxmemory, policy = found.get("maxmemory"), found.get("maxmemory-policy")
        if (maxmemory == "0" or policy not in _EVICTING_POLICIES) and self._throttle.should_warn("unbounded"):
            logger.warning(
                "Redis KV tier at %s: the server runs with maxmemory %s and maxmemory-policy %s; run it with "
                "maxmemory set and maxmemory-policy allkeys-lru, or it grows without bound or refuses writes when full",
                self._where,
                maxmemory,
                policy,
            )


def as_text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def count_leading_true(flags: Sequence[object]) -> int:
    """How many leading items are truthy."""
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count


def describe_url(url: str) -> str:
    """``url`` without credentials, for log lines."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"
