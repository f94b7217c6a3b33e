"""The host-memory tier: pages in a Redis server shared by every replica that points at it.

Layout in Redis (``prefix`` defaults to ``"prefixserve:"``)::

    {prefix}format                  -> b"1"   the page-key format version; claimed by the first replica (SET NX)
    {prefix}{dtype}:{storage id}    -> blob   one page: msgpack header + sealed KV bytes (see ``codec``, ``seal``)

Access: give the server a password (``redis://:PASSWORD@host:port/db``, or a user: ``redis://USER:PASSWORD@...``) and,
off the machine, TLS (``rediss://host:port/db?ssl_ca_certs=/path/ca.pem``; ``ssl_certfile`` / ``ssl_keyfile`` for client
certificates). Page names are keyed digests and the KV is encrypted under the cluster key, so a reader of the server
learns neither prompts nor which prompts were served; one who can write can only delete or plant entries that then
fail authentication (a miss, counted in ``discarded_corrupt``).

Eviction order: Redis' own LRU, steered by expiries, with retention (priority + TTL) on top::

    {prefix}{dtype}:{id}       plain page: stored with an expiry (``plain_ttl_s``, a day; a re-store refreshes it)
                               retained page: no expiry while its retention holds
    {prefix}retained:until     sorted set: page's Redis key -> end of its retention (wall clock; a pin: PINNED_UNTIL)
    {prefix}retained:priority  sorted set: page's Redis key -> its retention priority

Run the server with ``maxmemory`` and ``maxmemory-policy volatile-lru`` (deploy/redis.conf): Redis then evicts only
keys that have an expiry, least recently used first, so a retained page is never evicted while it is retained, and
plain pages go in LRU order. Retention reaches a page in two ways: a store of a page that carries a retention
(``StoredPage.retention_priority`` / ``retain_until``), and ``update_retention`` for pages stored before (an admin pin
or unpin, a request's retention given to cached pages); both merge like the other tiers (the stronger stays), all in
small Lua scripts so replicas sharing the server never leave a page without an expiry that no set names. A sweeper
(the writer thread, at most every ``sweep_interval_s``, before it writes) gives the pages whose retention ended their
expiry back, so they are plain LRU again (as if used at that sweep: Redis cannot set a key's idle time without
rewriting its value, and setting an expiry counts as a use; the same holds for an unpin). When memory is full of retained pages only, Redis refuses writes with
``OOM`` (volatile policies never evict a key without an expiry): the tier logs it (throttled), counts the pages in
``oom_refused`` and ``pages_dropped``, and ends the retention of the lowest-priority retained pages (earliest end among
equals), as many as the refused writes, so the next writes fit: as in the page pool, retention orders eviction but
never exempts a page from the memory bound. With ``allkeys-*`` policies the tier still works as a plain LRU cache,
but Redis may evict retained pages (the tier warns once); with no ``maxmemory`` pages are only bounded by their
expiry (the tier warns once). ``noeviction`` refuses writes when full (warned; counted as above).

The format marker may be evicted under ``allkeys-*``; that is harmless because every page header carries the key
format version too, and the marker is claimed again on the next (re)connection.

Loads: GETs pipelined ~2 MiB of values ahead (``LOAD_WINDOW_BYTES``, at least two values: one MGET made the server
build the whole reply in fresh memory first, see ``_get_streaming``); each reply is read off the socket into a reusable
buffer and the page decrypted from there straight into the tensor handed back (``ReplyReader``), so a loaded byte is
copied once by the kernel and written once by the decryption. A load of ``PARALLEL_MIN_PAGES`` pages or more is split in
``load_connections`` (2) parts read at the same time on as many connections (all but the first on the tier's own load
threads): one connection's reply stream is bound by ``redis-server`` writing it, and one thread decrypts at ~2.3 GB/s;
two streams and two decrypting threads moved ~1.5x as much (BENCHMARKS.md, section 0d); three or four moved no more
on two cores (section 0p, ``benchmarks/redis_load_parts.py``).

Faults: every call uses short socket timeouts (``socket_timeout_s``, 0.5 s; ``--redis-timeout``) and no client-side
retries. When Redis is unreachable the tier logs one warning, counts an error, and answers misses (lookup 0, load [],
store drops) without touching the network until a backoff passes; then one call probes, and on success the tier is
back (one more log line).
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor, wait
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
    RetentionUpdate,
    StatsRecorder,
    StoredPage,
    WarningThrottle,
    check_load_args,
    retention_of,
    wall_time,
)
from replica.tiers.circuit import BackoffPolicy, CircuitBreaker
from replica.tiers.codec import (
    MAX_HEADER_BYTES,
    RejectedEntry,
    decode_blob,
    encode_blob,
    new_page_tensors,
    sealed_size,
)
from replica.tiers.seal import TierKey
from replica.tiers.writer import BackgroundWriter

logger = logging.getLogger(__name__)

T = TypeVar("T")

_UNREACHABLE_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
_RETAINING_POLICIES = {"volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl"}
"""Policies that evict only keys with an expiry: retained pages (no expiry) stay."""
_EVICTING_POLICIES = {"allkeys-lru", "allkeys-lfu", "allkeys-random"} | _RETAINING_POLICIES
PLAIN_TTL_S = 86400
"""Expiry of a plain page (seconds): under ``volatile-*`` only keys with one are evicted; a re-store refreshes it."""
PINNED_UNTIL = 1e15
"""The end of a pin's retention in the ``retained:until`` set (a wall-clock time in ~31 million years)."""
SWEEP_LIMIT = 1000
"""Ended retentions handled per sweep."""
DEMOTE_MIN_PAGES = 8
"""At least this many retentions end when a write is refused for lack of memory."""

# Lua scripts (atomic on the server, so replicas sharing it never interleave inside one). KEYS[1] = the
# ``retained:until`` set, KEYS[2] = the ``retained:priority`` set, KEYS[3] = a page's key. A page key has no expiry
# only while both sets name it (a retain persists the key after adding it to both; every path that removes it from
# the sets gives the key its expiry back).
RETAIN_SCRIPT = """
if redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
local priority, deadline, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local old_priority = redis.call('ZSCORE', KEYS[2], KEYS[3])
local old_deadline = redis.call('ZSCORE', KEYS[1], KEYS[3])
if old_priority and old_deadline and tonumber(old_deadline) > now then
  old_priority = tonumber(old_priority)
  if old_priority > priority then return 1 end
  if old_priority == priority then deadline = math.max(deadline, tonumber(old_deadline)) end
end
redis.call('ZADD', KEYS[2], priority, KEYS[3])
redis.call('ZADD', KEYS[1], deadline, KEYS[3])
redis.call('PERSIST', KEYS[3])
return 1
"""
"""Merge a retention (ARGV: priority, end, now) into an existing page: the stronger stays (a higher priority replaces an
active lower one, the same priority keeps the later end, an ended one is replaced). 1 if the page exists."""
RELEASE_SCRIPT = """
local held = redis.call('ZREM', KEYS[2], KEYS[3])
redis.call('ZREM', KEYS[1], KEYS[3])
if redis.call('TTL', KEYS[3]) == -1 then redis.call('EXPIRE', KEYS[3], ARGV[1]) end
return held
"""
"""End a page's retention (unpin; ARGV: plain expiry): it gets its expiry back. 1 if it was retained."""
SWEEP_SCRIPT = """
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, member in ipairs(members) do
  redis.call('ZREM', KEYS[1], member)
  redis.call('ZREM', KEYS[2], member)
  if redis.call('TTL', member) == -1 then redis.call('EXPIRE', member, ARGV[2]) end
end
return #members
"""
"""End the retentions whose end is at or before ARGV[1] (at most ARGV[3]); their pages get the expiry ARGV[2]."""
DEMOTE_SCRIPT = """
local count = tonumber(ARGV[1])
local flat = redis.call('ZRANGE', KEYS[2], 0, count * 4 - 1, 'WITHSCORES')
local candidates = {}
for i = 1, #flat, 2 do
  local deadline = redis.call('ZSCORE', KEYS[1], flat[i])
  table.insert(candidates, {flat[i], tonumber(flat[i + 1]), tonumber(deadline or '0')})
end
table.sort(candidates, function(a, b)
  if a[2] ~= b[2] then return a[2] < b[2] end
  if a[3] ~= b[3] then return a[3] < b[3] end
  return a[1] < b[1]
end)
local demoted = {}
for i = 1, math.min(count, #candidates) do
  local member = candidates[i][1]
  redis.call('ZREM', KEYS[1], member)
  redis.call('ZREM', KEYS[2], member)
  if redis.call('TTL', member) == -1 then redis.call('EXPIRE', member, ARGV[2]) end
  table.insert(demoted, member)
end
return demoted
"""
"""Memory is full of retained pages: end the retention of ARGV[1] of them, lowest priority first, then earliest end
(among the 4 x ARGV[1] lowest-priority ones); they get the expiry ARGV[2], so Redis may evict them. Their keys."""
REFRESH_SCRIPT = """
if redis.call('TTL', KEYS[1]) > 0 then return redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return 0
"""
"""Restart a plain page's expiry (ARGV[1]); a retained page (no expiry) is left alone."""
LOAD_BATCH_BYTES = 32 << 20
"""At most this many sealed bytes per batch of a load (a call of ``_load_batch``)."""
LOAD_WINDOW_BYTES = 2 << 20
"""A load asks for the next values while it reads one, this many bytes of them ahead (at least two values)."""
PARALLEL_MIN_PAGES = 4
"""A load of at least this many pages is read in parts on several connections at the same time."""
LOAD_CONNECTIONS = 2
"""Connections (and threads) a load's parts are read on at once."""


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
        plain_ttl_s: int = PLAIN_TTL_S,
        sweep_interval_s: float = 1.0,
        wall_clock: Callable[[], float] | None = None,
        load_connections: int = LOAD_CONNECTIONS,
        load_window_bytes: int = LOAD_WINDOW_BYTES,
    ) -> None:
        if load_batch_pages < 1:
            raise ValueError(f"load_batch_pages must be at least 1, got {load_batch_pages}")
        if load_connections < 1:
            raise ValueError(f"load_connections must be at least 1, got {load_connections}")
        if not isinstance(plain_ttl_s, int) or plain_ttl_s < 1:
            raise ValueError(f"plain_ttl_s must be a whole number of seconds >= 1, got {plain_ttl_s!r}")
        self._plain_ttl_s = plain_ttl_s
        self._sweep_interval_s = sweep_interval_s
        self._wall_clock = wall_clock or wall_time
        self._clock = clock
        self._last_sweep = -math.inf
        self._retained_until_key = f"{key_prefix}retained:until"
        self._retained_priority_key = f"{key_prefix}retained:priority"
        self._page_format = page_format
        self._tier_key = tier_key or TierKey.generate()
        self._key_prefix = key_prefix
        self._marker_key = f"{key_prefix}format"
        self._page_key_prefix = f"{key_prefix}{page_format.dtype}:"
        self._load_batch_pages = max(1, min(load_batch_pages, LOAD_BATCH_BYTES // sealed_size(page_format)))
        self._max_value_bytes = sealed_size(page_format) + MAX_BLOB_OVERHEAD_BYTES
        self._load_window = max(2, load_window_bytes // self._max_value_bytes)
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
            write_pages=self._write_items,
            on_failure=self._count_dropped,
            capacity=queue_size,
            max_batch_pages=write_batch_pages,
        )
        self._load_connections = load_connections
        self._load_helper = ThreadPoolExecutor(max(1, load_connections - 1), thread_name_prefix="redis-tier-load")
        self._run(lambda client: client.ping(), default=None)  # connect now: format conflicts show at start-up

    # ---- KVTier -----------------------------------------------------------------------------------------------

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

    def residency(self, keys: Sequence[PageKey]) -> tuple[int, int]:
        """EXISTS and the retention end of each key, pipelined in one round trip."""
        if not keys:
            return 0, 0
        until_key = self._retained_until_key

        def probe(client: redis.Redis) -> list:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                redis_key = self.redis_key(key)
                pipe.exists(redis_key)
                pipe.zscore(until_key, redis_key)
            return pipe.execute()

        replies = self._run(probe, default=[])
        now = self._wall_clock()
        num_present = count_leading_true(replies[0::2])
        num_retained = sum(1 for until in replies[1 : 2 * num_present : 2] if until is not None and until > now)
        return num_present, num_retained

    def load(self, keys: Sequence[PageKey], token_ids_per_page: Sequence[Sequence[int]],
             out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """GETs pipelined in batches of ``load_batch_pages`` (``_get_streaming``); verify each page in order,
        decrypting it straight into its tensor; stop at the first miss."""
        check_load_args(self._page_format, keys, token_ids_per_page, out)
        start_time = time.perf_counter()
        loaded: list[torch.Tensor] = []
        pages = new_page_tensors(self._page_format, len(keys)) if out is None else out
        try:
            for batch_start in range(0, len(keys), self._load_batch_pages):
                batch_keys = keys[batch_start : batch_start + self._load_batch_pages]
                batch_tokens = token_ids_per_page[batch_start : batch_start + self._load_batch_pages]
                batch_loaded = self._load_parts(batch_keys, batch_tokens, pages[batch_start:])
                loaded.extend(batch_loaded)
                if len(batch_loaded) < len(batch_keys):
                    break
        finally:
            self._record_load(len(loaded), start_time)
        return loaded

    def _load_parts(self, keys: Sequence[PageKey], token_ids_per_page: Sequence[Sequence[int]],
                     out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``_load_batch`` in up to ``load_connections`` contiguous parts of at least ``PARALLEL_MIN_PAGES // 2``
        pages, read at the same time: the first on this thread, the others on the load threads (each on a connection
        of its own). A part counts only if every part before it came back whole (the answer is a leading run)."""
        num_parts = min(self._load_connections, len(keys) // max(1, PARALLEL_MIN_PAGES // 2))
        if len(keys) < PARALLEL_MIN_PAGES or num_parts < 2:
            return self._load_batch(keys, token_ids_per_page, out)
        bounds = [-(-len(keys) * part // num_parts) for part in range(num_parts + 1)]  # the first part the largest
        later: list[Future] = []
        try:
            for start, stop in zip(bounds[1:-1], bounds[2:]):
                later.append(self._load_helper.submit(self._load_batch, keys[start:stop],
                                                      token_ids_per_page[start:stop], out[start:stop]))
        except RuntimeError:  # closed meanwhile: the parts already started write into ``out`` too; let them end
            wait(later)
            return self._load_batch(keys, token_ids_per_page, out)
        try:
            parts = [self._load_batch(keys[: bounds[1]], token_ids_per_page[: bounds[1]], out[: bounds[1]])]
            parts.extend(future.result() for future in later)
        finally:  # nothing writes into ``out`` (perhaps the KV pool's pages) once this has returned or raised
            wait(later)
        loaded: list[torch.Tensor] = []
        for part, start, stop in zip(parts, bounds, bounds[1:]):
            loaded.extend(part)
            if len(part) < stop - start:
                break
        return loaded

    def close(self, timeout: float | None = 5.0) -> None:
        if self._closed:
            return
        self._writer.close(timeout)
        self._close_events()
        self._closed = True
        self._load_helper.shutdown(wait=True)
        self._client.close()

    def enable_events(self, sink, *, resync_interval_s: float = 60.0) -> None:
        """Publish KV events (medium "CPU") for the pages this tier stores, and their removal by anyone (Redis'
        evictions included: keyevent notifications, see ``replica.tiers.events.RedisRemovalSource``)."""
        from common.events import MEDIUM_HOST
        from replica.tiers.events import RedisRemovalSource, TierEventTracker

        if self._events is None:
            source = RedisRemovalSource(self._client, self._page_key_prefix, self._run, self._url)
            self._events = TierEventTracker(MEDIUM_HOST, source, sink, self.redis_key,
                                            resync_interval_s=resync_interval_s, on_published=self._count_events)

    # ---- internals ----------------------------------------------------------------------------------------------

    def redis_key(self, key: PageKey) -> str:
        """The Redis key of page ``key`` in this tier's namespace."""
        return self._page_key_prefix + self._tier_key.storage_id(key)

    def _load_batch(self, keys: Sequence[PageKey], token_ids_per_page: Sequence[Sequence[int]],
                    out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The values of ``keys`` (``_get_streaming``), each decrypted into ``out[i]`` as soon as it has arrived."""
        loaded: list[torch.Tensor] = []
        redis_keys = [self.redis_key(key) for key in keys]

        def take(index: int, value) -> bool:
            if value is None:
                return False
            if value is OVERSIZED:
                rejected.append((keys[index], f"a value over {self._max_value_bytes} bytes"))
                return False
            try:
                loaded.append(decode_blob(value, self._page_format, self._tier_key, keys[index],
                                          token_ids_per_page[index], out[index]))
            except RejectedEntry as exc:
                rejected.append((keys[index], str(exc)))
                return False
            return True

        rejected: list[tuple[PageKey, str]] = []
        self._run(lambda client: self._get_streaming(client, redis_keys, take), default=None)
        for key, reason in rejected:
            self._discard(key, reason)
        return loaded

    def _get_streaming(self, client: redis.Redis, redis_keys: list[str], take: Callable[[int, object], bool]) -> None:
        """GET ``redis_keys`` pipelined, at most ``_load_window`` values asked ahead of the one being read, and call
        ``take(i, value)`` for each value in order (a memoryview valid only during the call, or None for a missing
        key) until it returns False.

        Not one MGET: redis-server builds an MGET's whole reply before it writes any of it, in memory its allocator
        has to map afresh (after a pause, or after new values took the last reply's memory): 16 MiB cost ~4100 page
        faults, 10.8-13.2 ms against 4.6-6.7 ms for GETs two at a time, whose ~2 MiB of replies the allocator reuses
        from value to value (BENCHMARKS.md, section 0zh). The reply is read straight off the connection's socket into
        this thread's reusable buffer (a page at a time): redis-py would copy every value twice more (into its parser,
        then into a new bytes object), which cost more CPU than decrypting. Falls back to one MGET read by redis-py's
        parser on a connection without a plain socket. After ``take`` says stop no more GETs are sent and the replies
        already asked for are read and dropped; a timeout, an oversized value or anything unexpected closes that
        connection instead."""
        pool = client.connection_pool
        connection = pool.get_connection()
        try:
            sock = getattr(connection, "_sock", None)
            if sock is None or not hasattr(sock, "recv_into"):
                connection.send_command("MGET", *redis_keys)
                values = connection.read_response()
                for index, value in enumerate(values):
                    if not take(index, value):
                        break
                return
            reader = ReplyReader(sock, reply_buffer(self._max_value_bytes + 64))
            num_asked = min(self._load_window, len(redis_keys))
            try:
                connection.send_packed_command(connection.pack_commands(  # no health check: it would read a reply
                    [("GET", redis_key) for redis_key in redis_keys[:num_asked]]), check_health=False)
                for index in range(len(redis_keys)):
                    value = reader.bulk(self._max_value_bytes)
                    if value is OVERSIZED:  # not read (``take`` sees it): the connection cannot be reused
                        take(index, value)
                        raise _AbandonedReply()
                    if num_asked < len(redis_keys):  # the next value, asked while this one is decrypted: the server
                        connection.send_packed_command(connection.pack_command("GET", redis_keys[num_asked]),
                                                       check_health=False)
                        num_asked += 1  # has another to write meanwhile
                    if not take(index, value):
                        for _ in range(index + 1, num_asked):  # read and drop the values asked (the connection stays)
                            if reader.bulk(self._max_value_bytes) is OVERSIZED:
                                raise _AbandonedReply()
                        break
            except _AbandonedReply:
                connection.disconnect()
            except socket.timeout as exc:
                connection.disconnect()
                raise redis.TimeoutError(f"reading a GET reply: {exc}") from None
            except (OSError, redis.ResponseError):
                connection.disconnect()
                raise
            except ValueError as exc:  # a malformed reply
                connection.disconnect()
                raise redis.ResponseError(f"malformed GET reply: {exc}") from None
        except BaseException:
            connection.disconnect()
            raise
        finally:
            pool.release(connection)

    def _discard(self, key: PageKey, reason: str) -> None:
        self._stats.add(discarded_corrupt=1)
        if self._throttle.should_warn("discard"):
            logger.warning("Redis KV tier at %s: discarding page %s: %s", self._where, self.redis_key(key), reason)
        self._run(lambda client: client.delete(self.redis_key(key)), default=0)

    def _write_items(self, items: list) -> None:
        self._sweep_if_due()
        super()._write_items(items)

    def _write_pages(self, pages: list[StoredPage]) -> None:
        """Writer thread: one pipelined round trip for the batch. Per page ``SET NX`` with the plain expiry (a page
        already there keeps its value: same key, same tokens), then either ``RETAIN_SCRIPT`` (the page carries a
        retention that has not ended) or ``REFRESH_SCRIPT`` (restart a plain page's expiry)."""
        start_time = time.perf_counter()
        now = self._wall_clock()
        entries = []
        for page in pages:
            priority, until = retention_of(page)
            entries.append((self.redis_key(page.key), encode_blob(page, self._tier_key),
                            priority if until > now else 0, until))

        def write(client: redis.Redis) -> list:
            pipe = client.pipeline(transaction=False)
            for redis_key, blob, priority, until in entries:
                pipe.set(redis_key, blob, nx=True, ex=self._plain_ttl_s)
                if priority:
                    pipe.eval(RETAIN_SCRIPT, 3, self._retained_until_key, self._retained_priority_key, redis_key,
                              priority, repr(min(until, PINNED_UNTIL)), repr(now))
                else:
                    pipe.eval(REFRESH_SCRIPT, 1, redis_key, self._plain_ttl_s)
            return pipe.execute(raise_on_error=False)

        results = self._run(write, default=None)
        if results is None:
            self._count_dropped(pages)
            self._stats.add(store_seconds=time.perf_counter() - start_time)
            self._note_written(pages)
            return
        num_stored = num_oom = 0
        failures: list[BaseException] = []
        written = []
        for index, page in enumerate(pages):
            stored, followed = results[2 * index], results[2 * index + 1]
            if isinstance(stored, BaseException):
                failures.append(stored)
                num_oom += is_out_of_memory(stored)
                continue
            num_stored += 1
            written.append(page)
            if isinstance(followed, BaseException):
                failures.append(followed)
                if entries[index][2]:
                    self._stats.add(retention_updates_dropped=1)
        self._stats.add(
            pages_stored=num_stored,
            bytes_stored=num_stored * self._page_format.page_num_bytes,
            pages_dropped=len(pages) - num_stored,
            errors=sum(1 for failure in failures if not is_out_of_memory(failure)),
            store_seconds=time.perf_counter() - start_time,
        )
        self._warn_failures(failures)
        if num_oom:
            self._relieve_memory(num_oom)
        self._note_written(written)

    def _apply_retention(self, updates: list[RetentionUpdate]) -> None:
        """Writer thread: one pipelined round trip of ``RETAIN_SCRIPT`` / ``RELEASE_SCRIPT`` per update (an update
        whose retention has already ended changes nothing)."""
        now = self._wall_clock()
        sets = (self._retained_until_key, self._retained_priority_key)
        sent = []
        for update in updates:
            priority, until = retention_of(update)
            if update.releases or until > now:
                sent.append((self.redis_key(update.key), update.releases, priority, until))
        if not sent:
            return

        def apply(client: redis.Redis) -> list:
            pipe = client.pipeline(transaction=False)
            for redis_key, releases, priority, until in sent:
                if releases:
                    pipe.eval(RELEASE_SCRIPT, 3, *sets, redis_key, self._plain_ttl_s)
                else:
                    pipe.eval(RETAIN_SCRIPT, 3, *sets, redis_key, priority, repr(min(until, PINNED_UNTIL)), repr(now))
            return pipe.execute(raise_on_error=False)

        results = self._run(apply, default=None)
        if results is None:
            self._stats.add(retention_updates_dropped=len(sent))
            return
        failures = [result for result in results if isinstance(result, BaseException)]
        self._stats.add(retention_updates=sum(1 for result in results
                                              if not isinstance(result, BaseException) and result),
                        retention_updates_dropped=len(failures), errors=len(failures))
        self._warn_failures(failures)

    def sweep(self) -> int:
        """End the retentions whose time has passed (their pages get the plain expiry back); returns how many. The
        writer calls it at most every ``sweep_interval_s`` before writing; any replica's sweep serves every replica
        sharing the server."""
        self._last_sweep = self._clock()
        num_expired = self._run(lambda client: client.eval(
            SWEEP_SCRIPT, 2, self._retained_until_key, self._retained_priority_key,
            repr(self._wall_clock()), self._plain_ttl_s, SWEEP_LIMIT), default=0)
        if num_expired:
            self._stats.add(retention_expired=int(num_expired))
        return int(num_expired or 0)

    def retention_of_page(self, key: PageKey) -> tuple[int, float] | None:
        """``(priority, end)`` of a stored page's retention in the server (``math.inf`` for a pin), or None when it
        holds none (for tests and debugging)."""
        redis_key = self.redis_key(key)

        def read(client: redis.Redis):
            pipe = client.pipeline(transaction=False)
            pipe.zscore(self._retained_priority_key, redis_key)
            pipe.zscore(self._retained_until_key, redis_key)
            return pipe.execute()

        priority, until = self._run(read, default=(None, None))
        if priority is None or until is None:
            return None
        return int(priority), math.inf if until >= PINNED_UNTIL else float(until)

    def _sweep_if_due(self) -> None:
        if self._clock() - self._last_sweep >= self._sweep_interval_s:
            self.sweep()

    def _relieve_memory(self, num_refused: int) -> None:
        """Redis refused writes for lack of memory (only retained pages are left, or ``noeviction``): end the
        retention of the lowest-priority retained pages so the next writes fit (see the module docstring)."""
        self._stats.add(oom_refused=num_refused)
        demoted = self._run(lambda client: client.eval(
            DEMOTE_SCRIPT, 2, self._retained_until_key, self._retained_priority_key,
            max(DEMOTE_MIN_PAGES, num_refused), self._plain_ttl_s), default=[]) or []
        if demoted:
            self._stats.add(retention_expired=len(demoted))
        if self._throttle.should_warn("oom"):
            if demoted:
                remedy = (f"Ended the retention of {len(demoted)} lowest-priority page(s) so later writes fit. Give "
                          "Redis more memory or retain less.")
            else:
                remedy = ("No retained page was left to release: keys without an expiry that no replica retains fill "
                          "it (pages written by a version before retention, or other data), or the policy is "
                          "noeviction. Flush the tier's database once, or run maxmemory-policy allkeys-lru.")
            logger.warning(
                "Redis KV tier at %s: the server refused %d page write(s) for lack of memory (maxmemory reached and "
                "nothing it may evict); the pages are dropped. %s", self._where, num_refused, remedy)

    def _warn_failures(self, failures: list[BaseException]) -> None:
        other = [failure for failure in failures if not is_out_of_memory(failure)]
        if other and self._throttle.should_warn("command"):
            logger.warning("Redis KV tier at %s: command failed: %s: %s", self._where, type(other[0]).__name__,
                           other[0])

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
        problem = None
        if maxmemory == "0":
            problem = (f"no maxmemory: it grows until plain pages expire ({self._plain_ttl_s} s) and pinned pages "
                       "are unpinned")
        elif policy not in _EVICTING_POLICIES:
            problem = "it refuses writes when full (counted in oom_refused)"
        elif policy not in _RETAINING_POLICIES:
            problem = "it evicts retained (pinned) pages like any other"
        if problem is not None and self._throttle.should_warn("unbounded"):
            logger.warning(
                "Redis KV tier at %s: the server runs with maxmemory %s and maxmemory-policy %s: %s. Run it with "
                "maxmemory set and maxmemory-policy volatile-lru (deploy/redis.conf)",
                self._where,
                maxmemory,
                policy,
                problem,
            )


MAX_BLOB_OVERHEAD_BYTES = 8 + MAX_HEADER_BYTES
"""A page's Redis value is at most its sealed KV plus this (prefix + the largest accepted header)."""


class _AbandonedReply(Exception):
    """The rest of a reply is not wanted: the connection is closed instead of reading it."""


class _Oversized:
    def __repr__(self) -> str:
        return "OVERSIZED"


OVERSIZED = _Oversized()
"""What ``ReplyReader.bulk`` answers for a value longer than the caller accepts (it is not read)."""

_reply_buffers = threading.local()


def reply_buffer(num_bytes: int) -> bytearray:
    """This thread's reusable reply buffer (at least ``num_bytes``; twice that so a value and the start of the next
    fit without moving bytes around often)."""
    buffer = getattr(_reply_buffers, "buffer", None)
    if buffer is None or len(buffer) < 2 * num_bytes:
        buffer = _reply_buffers.buffer = bytearray(2 * num_bytes)
    return buffer


class ReplyReader:
    """Reads RESP2 / RESP3 replies of bulk strings (an MGET's array, or pipelined GETs' values) from a socket into
    ``buffer``.

    Header lines are at most ``MAX_LINE`` bytes; a value is handed out as a view of the buffer that stays valid until
    the next call. Raises ValueError on anything that is not such a reply, redis.ResponseError for an error reply,
    ConnectionError when the server closes the connection, and the socket's own errors (timeouts)."""

    MAX_LINE = 64

    def __init__(self, sock, buffer: bytearray) -> None:
        self._sock = sock
        self._buffer = buffer
        self._view = memoryview(buffer)
        self._start = 0
        self._end = 0

    def array_length(self) -> int:
        line = self._line()
        if line[:1] == b"-":
            raise redis.ResponseError(line[1:].decode(errors="replace"))
        if line[:1] != b"*":
            raise ValueError(f"expected an array, got {line[:16]!r}")
        return int(line[1:])

    def bulk(self, max_bytes: int):
        """The next value (a memoryview), None for a missing key, or OVERSIZED (not read) past ``max_bytes``."""
        line = self._line()
        if line == b"_" or line == b"$-1":  # RESP3 / RESP2 null
            return None
        if line[:1] == b"-":
            raise redis.ResponseError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise ValueError(f"expected a bulk string, got {line[:16]!r}")
        length = int(line[1:])
        if length < 0:
            raise ValueError(f"bulk string of length {length}")
        if length > max_bytes:
            return OVERSIZED
        self._fill(length + 2)
        start = self._start
        if self._buffer[start + length : start + length + 2] != b"\r\n":
            raise ValueError("bulk string not terminated by CRLF")
        self._start = start + length + 2
        return self._view[start : start + length]

    def _line(self) -> bytes:
        while True:
            end = self._buffer.find(b"\r\n", self._start, self._end)
            if end >= 0:
                line = bytes(self._view[self._start : end])
                self._start = end + 2
                return line
            if self._end - self._start >= self.MAX_LINE:
                raise ValueError("header line too long")
            self._fill(self._end - self._start + 1)

    def _fill(self, num_bytes: int) -> None:
        """Make ``num_bytes`` bytes available from ``_start`` (moving the unread rest to the front if needed)."""
        if num_bytes > len(self._buffer):
            raise ValueError(f"a reply element of {num_bytes} bytes does not fit the {len(self._buffer)}-byte buffer")
        if self._start + num_bytes > len(self._buffer):
            unread = self._end - self._start
            self._view[:unread] = self._view[self._start : self._end]
            self._start, self._end = 0, unread
        while self._end - self._start < num_bytes:
            received = self._sock.recv_into(self._view[self._end :], len(self._buffer) - self._end)
            if received == 0:
                raise ConnectionError("the server closed the connection mid-reply")
            self._end += received


def is_out_of_memory(error: BaseException) -> bool:
    """Redis' ``OOM command not allowed when used memory > 'maxmemory'`` (also when raised inside a script)."""
    return isinstance(error, redis.exceptions.OutOfMemoryError) or "OOM" in str(error)[:40]


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
