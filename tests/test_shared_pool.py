"""Peer copy from a CPU holder's pool in shared memory (replica/shared_pool.py), without Ray.

Checked: the engine's pool lives in shared memory when peer copy is on; a receiver's copy of shared pages is bit-equal
to the holder's own export; a page the holder reuses (evicted, reset) before or during the copy is dropped with the
pages after it; a pool that cannot be opened, or is not the one named, is refused and the client asks for a host
bundle instead; without shared memory the engine works on private memory and offers nothing. The cross-process copy
and greedy equality are in tests/test_peer_transport.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

from common.types import CacheSource, EngineRequest, SamplingParams
from replica import shared_pool
from replica.export_index import ExportIndex
from replica.peer_copy import PeerExportRequest, ServePeerClient, bundle_pages
from replica.shared_pool import PoolReader, SharedPool, SharedPoolBundle, map_pool
from tests.engine_utils import TinyModel
from test_peer_transport import CpuHolderOfferingIpc

PAGE = 128


@pytest.fixture(scope="module")
def tiny():
    return TinyModel("llama")


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (length,), generator=generator).tolist()


def run(engine, tokens: list[int], request_id: str) -> None:
    engine.add_request(EngineRequest(request_id, tokens, SamplingParams(max_tokens=1, temperature=0.0)))
    while engine.has_work():
        engine.step()


def test_a_peer_copies_shared_pages_bit_exact_and_drops_them_once_reused(tiny):
    holder = tiny.engine(num_pages=8)
    assert holder.runner.shared_pool is not None  # peer copy on, CPU: the pool is shared memory
    assert holder.runner.kv_cache.data_ptr() == holder.runner.shared_pool.kv.data_ptr()
    first = prompt(3 * PAGE + 5, seed=1)
    run(holder, first, "a")
    keys = holder.page_keys(first)

    bundle = holder.share_pages(keys + [b"\x01" * 32])  # a key it never held ends the run
    assert bundle.keys == keys and bundle.page_ids == [holder.kv.cache.lookup(key) for key in keys]
    reader = PoolReader()
    copied = reader.copy_pages(bundle)
    exported = holder.export_pages(keys)
    assert [(page.key, page.token_ids) for page in copied] == [(page.key, page.token_ids) for page in exported]
    assert all(torch.equal(mine.kv, theirs.kv) for mine, theirs in zip(copied, exported))
    assert {page.source for page in copied} == {CacheSource.PEER}
    assert all(page.kv.data_ptr() != holder.runner.kv_cache.data_ptr() for page in copied)  # owned copies

    # the holder evicts the prefix for other prompts: the same answer now copies nothing
    for seed in range(2, 6):
        run(holder, prompt(3 * PAGE + 5, seed=10 + seed), f"b{seed}")
    assert holder.kv.match_prefix(keys) == []
    assert reader.copy_pages(bundle) == []
    assert reader.num_stale_pages == 3

    run(holder, first, "c")  # computed again: a fresh answer copies again, and a reset makes that one stale
    again = holder.share_pages(keys)
    assert len(reader.copy_pages(again)) == 3
    assert holder.reset_prefix_cache()
    assert reader.copy_pages(again) == []


def publish_every_page(pool: SharedPool):
    """An export index over ``pool`` with page i published under key i + 1: (index, keys, found, the holder's answer
    for them)."""
    index = ExportIndex()
    index.generations = pool.generations
    keys = [bytes([n + 1]) * 32 for n in range(pool.kv.shape[2])]
    for page_id, key in enumerate(keys):
        index.publish(key, page_id, (page_id,))
    found, generations = index.published_prefix(keys)
    bundle = pool.bundle([page.key for page in found], [page.token_ids for page in found],
                         [page.page_id for page in found], generations)
    return index, keys, found, bundle


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_page_reused_while_it_is_copied_ends_the_run_there(dtype):
    pool = SharedPool((1, 2, 4, 8, 1, 4), dtype)
    pool.kv.copy_(torch.arange(pool.kv.numel(), dtype=torch.float32).view(pool.kv.shape).to(dtype))
    index, keys, found, bundle = publish_every_page(pool)
    reader = PoolReader()
    kv, gens = reader._mapped(bundle.location)

    class ReusedMidCopy:
        """The holder withdraws page 2's key (and would rewrite it) while the receiver copies page 1."""

        def __getitem__(self, item):
            if item[2] == 1:
                index.withdraw(keys[2])
            return kv[item]

    reader._mappings[(bundle.location.pid, bundle.location.fd, bundle.location.inode)] = (ReusedMidCopy(), gens)
    copied = reader.copy_pages(bundle)
    assert [page.key for page in copied] == keys[:2]
    assert all(page.kv.dtype == dtype and torch.equal(page.kv, pool.kv[:, :, n]) for n, page in enumerate(copied))
    assert reader.num_stale_pages == 2
    assert index.published_prefix(keys)[0] == found[:2]  # no new copy can start on the withdrawn page


def test_a_pool_that_is_not_the_one_named_is_refused():
    pool = SharedPool((1, 2, 2, 8, 1, 4), torch.bfloat16)
    location = pool.location
    kv, _ = map_pool(location)
    assert kv.shape == pool.kv.shape
    with pytest.raises(ValueError, match="not the pool"):
        map_pool(dataclasses.replace(location, inode=location.inode + 1))
    with pytest.raises(ValueError, match="not the pool"):
        map_pool(dataclasses.replace(location, nbytes=location.nbytes + 8))
    with pytest.raises(ValueError, match="not the pool"):
        map_pool(dataclasses.replace(location, device=location.device + 1))
    with pytest.raises(ValueError, match="layout"):
        map_pool(dataclasses.replace(location, generations_offset=8))
    with pytest.raises(OSError):
        map_pool(dataclasses.replace(location, fd=location.fd + 1000))
    pool.close()
    with pytest.raises(OSError):  # closed: no longer offered
        map_pool(location)


class HolderWithBadPool(CpuHolderOfferingIpc):
    """A handle whose holder answers a shared-pool bundle this process cannot open, then (asked again) a host one."""

    def __init__(self, pages, location) -> None:
        super().__init__(pages)
        self.location = location

    async def _answer(self, request):
        if request.node_id is None:
            return bundle_pages(self.pages)
        return SharedPoolBundle([page.key for page in self.pages], [list(page.token_ids) for page in self.pages],
                                [0, 1], [0, 0], self.location)


def test_an_unopenable_shared_pool_falls_back_to_a_host_copy():
    from replica.page_record import PageRecord

    pages = [PageRecord(bytes([n + 1]) * 32, (n,), torch.full((1, 2, 8, 1, 4), float(n))) for n in range(2)]
    pool = SharedPool((1, 2, 2, 8, 1, 4), torch.float32)
    handle = HolderWithBadPool(pages, dataclasses.replace(pool.location, inode=pool.location.inode + 1))
    client = ServePeerClient("unused", "unused", handle=handle)
    assert client.node_id == shared_pool.node_id()

    got = asyncio.run(client.fetch("holder", [page.key for page in pages]))

    assert [request.node_id for request in handle.requests] == [client.node_id, None]
    assert all(torch.equal(page.kv, want.kv) for page, want in zip(got, pages)) and len(got) == 2
    assert client.transport_stats.pages == {"cuda_ipc": 0, "shared_memory": 0, "host": 2, "tcp": 0}
    assert client.transport_stats.shared_memory_failures == 1


def test_without_shared_memory_the_pool_is_private_and_nothing_is_shared(tiny, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(os, "memfd_create", refuse)
    engine = tiny.engine(num_pages=8)
    assert engine.runner.shared_pool is None and engine.kv.exports.generations is None
    tokens = prompt(2 * PAGE + 3, seed=7)
    run(engine, tokens, "a")
    assert engine.share_pages(engine.page_keys(tokens)) is None
    assert len(engine.export_pages(engine.page_keys(tokens))) == 2
    monkeypatch.undo()
    assert tiny.engine(num_pages=8, share_kv_pool=False).runner.shared_pool is None
    assert tiny.engine(num_pages=8, enable_peer_copy=False).runner.shared_pool is None
    assert PeerExportRequest("r", []).node_id is None  # an old-style request is answered with a host bundle


# ---- the export call over the holder's socket (replica/pool_socket.py) ---------------------------------------------


class HolderOverHandle:
    """A handle that answers ``export_pages`` with the holder engine's ``share_pages`` (what the Ray path answers)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls = 0
        outer = self

        class Export:
            @staticmethod
            def remote(request):
                outer.calls += 1
                return outer._answer(request)

        self.export_pages = Export

    async def _answer(self, request):
        return self.engine.share_pages(list(request.keys))


def socket_holder(tiny, *prompts: list[int]):
    """A holder engine serving exports on its socket, having computed ``prompts``: (engine, its shared pool)."""
    holder = tiny.engine(num_pages=8)
    pool = holder.runner.shared_pool
    pool.serve_exports(holder.share_pages)
    for number, tokens in enumerate(prompts):
        run(holder, tokens, f"p{number}")
    return holder, pool


def test_after_one_call_through_the_handle_a_peer_asks_the_holders_socket_and_falls_back_when_it_goes(tiny):
    first, second = prompt(2 * PAGE + 3, seed=21), prompt(PAGE + 9, seed=22)
    holder, pool = socket_holder(tiny, first, second)
    assert pool.location.socket.startswith("\0prefixserve-pool-")
    handle = HolderOverHandle(holder)
    client = ServePeerClient("unused", "unused", handle=handle)

    async def fetch(tokens, extra=()):
        return await client.fetch("holder", holder.page_keys(tokens) + list(extra))

    async def scenario():
        got_first = await fetch(first)
        assert handle.calls == 1 and client.transport_stats.socket_exports == 0
        got_second = await fetch(second, extra=[b"\x07" * 32])  # an unknown key ends the run, as through Ray
        assert handle.calls == 1 and client.transport_stats.socket_exports == 1
        assert await fetch([]) == [] and client.transport_stats.socket_exports == 2
        return got_first, got_second

    async def after_the_socket_is_gone():
        pool.stop_serving_exports()  # asked through the handle again, and then
        got = await fetch(second)  # no socket is named any more
        assert handle.calls == 2 and client.transport_stats.socket_failures == 1
        assert await fetch(second) and handle.calls == 3
        return got

    got_first, got_second = asyncio.run(scenario())
    # another event loop (the first one is closed, with idle connections on it) opens its own connection
    assert len(asyncio.run(fetch(first))) == 2 and handle.calls == 1
    assert client.transport_stats.socket_exports == 3 and client.transport_stats.socket_failures == 0
    uvloop = pytest.importorskip("uvloop")  # Serve's event loop: it refuses an abstract socket name given as a path
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert len(runner.run(fetch(first))) == 2 and handle.calls == 1
    assert client.transport_stats.socket_exports == 4 and client.transport_stats.socket_failures == 0
    got_again = asyncio.run(after_the_socket_is_gone())
    for tokens, got in ((first, got_first), (second, got_second), (second, got_again)):
        want = holder.export_pages(holder.page_keys(tokens))
        assert [(page.key, page.token_ids) for page in got] == [(page.key, page.token_ids) for page in want]
        assert all(torch.equal(mine.kv, theirs.kv) for mine, theirs in zip(got, want))
    assert client.transport_stats.pages["shared_memory"] == 2 + 1 + 2 + 2 + 1 + 1


def test_an_export_socket_answers_only_its_pid_and_refuses_malformed_requests(tiny):
    import socket as sockets
    import struct

    from replica import pool_socket

    tokens = prompt(PAGE + 1, seed=23)
    holder, pool = socket_holder(tiny, tokens)
    keys = holder.page_keys(tokens)
    client = pool_socket.ExportClient()
    name, pid = pool.location.socket, pool.location.pid

    async def ask(asked_pid):
        return await client.ask(name, asked_pid, keys)

    found, page_ids, generations, token_ids = asyncio.run(ask(pid))
    assert found == keys and page_ids == [holder.kv.cache.lookup(keys[0])] and token_ids == [tokens[:PAGE]]
    with pytest.raises(ConnectionError, match="not the holder's"):  # a name another process answers is refused
        asyncio.run(ask(pid + 1))
    with pytest.raises(ValueError):
        pool_socket.encode_request([b"short"])

    def exchange(payload: bytes) -> bytes:
        with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as raw:
            raw.settimeout(10)
            raw.connect(name)
            raw.sendall(payload)
            raw.shutdown(sockets.SHUT_WR)
            try:
                return raw.recv(1 << 16)
            except ConnectionResetError:  # hung up with our bytes unread
                return b""

    assert exchange(b"HTTP/1.1 GET /\r\n") == b""  # not our magic: hung up, nothing answered
    assert exchange(struct.pack("<4sI", b"PSXE", pool_socket.MAX_KEYS + 1)) == b""  # too many keys: not even read
    assert exchange(struct.pack("<4sI", b"PSXE", 2) + keys[0]) == b""  # cut short
    answer = exchange(pool_socket.encode_request(keys))
    assert pool_socket.decode_answer_header(answer[:12]) == (1, PAGE)

    # an answer must name only the leading run of what was asked, with token counts that add up
    body = pool_socket.encode_answer(keys, [0], [0], [tokens[:PAGE]])[12:]
    with pytest.raises(ConnectionError, match="not asked"):
        pool_socket.decode_answer_body(body, 1, [b"\x09" * 32])
    with pytest.raises(ConnectionError, match="out of bounds"):
        pool_socket.decode_answer_header(struct.pack("<4sII", b"PSXA", 2, 2 * pool_socket.MAX_TOKENS_PER_PAGE + 1))
    with pytest.raises(ConnectionError, match="could not answer"):
        pool_socket.decode_answer_header(pool_socket.failed_answer())
    pool.stop_serving_exports()


def test_a_failed_socket_is_not_learned_again_for_a_while_and_a_dead_server_is_not_named(tiny):
    import threading

    tokens = prompt(PAGE + 3, seed=31)
    holder, pool = socket_holder(tiny, tokens)
    keys = holder.page_keys(tokens)
    handle = HolderOverHandle(holder)
    client = ServePeerClient("unused", "unused", handle=handle)

    async def scenario():
        assert len(await client.fetch("holder", keys)) == 1 and handle.calls == 1  # learns the socket
        # the socket now fails (as from another network namespace: here, it names another pid)
        client._export_sockets["holder"] = dataclasses.replace(pool.location, pid=pool.location.pid + 1)
        assert len(await client.fetch("holder", keys)) == 1 and handle.calls == 2
        assert client.transport_stats.socket_failures == 1
        assert len(await client.fetch("holder", keys)) == 1 and handle.calls == 3  # not learned again yet
        assert client.transport_stats.socket_failures == 1 and "holder" not in client._export_sockets

    asyncio.run(scenario())
    client.close()

    # a server whose accept thread has ended is not named in bundles (peers would wait on it until their timeout)
    assert holder.share_pages(keys).location.socket == pool.location.socket
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    live, pool.export_server._thread = pool.export_server._thread, dead
    assert holder.share_pages(keys).location.socket is None
    pool.export_server._thread = live
    pool.stop_serving_exports()


def test_the_export_server_keeps_accepting_after_a_failed_accept_and_the_client_bounds_answers(tiny):
    import errno
    import socket as sockets
    import struct
    import threading

    from replica import pool_socket

    tokens = prompt(PAGE + 3, seed=32)
    holder, pool = socket_holder(tiny, tokens)
    server = pool.export_server
    keys = holder.page_keys(tokens)
    real = server._listener

    class FailsOnce:
        """The listener, whose next accept fails as when the process is out of descriptors."""

        def __init__(self) -> None:
            self.failed = False

        def accept(self):
            if not self.failed:
                self.failed = True
                raise OSError(errno.EMFILE, "Too many open files")
            return real.accept()

        def __getattr__(self, name):
            return getattr(real, name)

    flaky = FailsOnce()
    server._listener = flaky  # the accept already waiting takes the first connection, the next accept fails once
    client = pool_socket.ExportClient(max_idle_per_holder=0)  # a new connection for every ask

    async def ask():
        return await asyncio.wait_for(client.ask(server.name, os.getpid(), keys), timeout=10)

    assert asyncio.run(ask())[0] == keys
    assert asyncio.run(ask())[0] == keys and flaky.failed and server.serving
    server._listener = real
    pool.stop_serving_exports()

    # an answer claiming more pages than were asked is refused before its body is read (none is ever sent here)
    listener = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    name = f"\0prefixserve-test-{os.getpid()}-{threading.get_ident()}"
    listener.bind(name)
    listener.listen(1)

    def lying_holder():
        conn, _ = listener.accept()
        conn.recv(1 << 16)
        conn.sendall(struct.pack("<4sII", b"PSXA", 5, 0))
        conn.recv(1)  # until the client hangs up
        conn.close()

    thread = threading.Thread(target=lying_holder, daemon=True)
    thread.start()
    with pytest.raises(ConnectionError, match="more pages than were asked"):
        asyncio.run(asyncio.wait_for(client.ask(name, os.getpid(), keys), timeout=10))
    thread.join(timeout=10)
    listener.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_peer_copies_into_the_receiver_s_pool_pages_and_nothing_else(dtype):
    """Landing pages (replica/landing.py) on the same node: the receiver copies a holder's pages straight into pool
    pages of its own; each record is the page it wrote and names it; no other byte of the receiver's pool changes; a
    page reused during the copy ends the run there; given pages of another shape or dtype, or too few, it copies into
    tensors of its own (and names no page)."""
    from replica.landing import LandingPages

    pool = SharedPool((2, 2, 4, 8, 1, 4), dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape).to(dtype))
    index, keys, _found, bundle = publish_every_page(pool)
    receiver = torch.full((2, 2, 6, 8, 1, 4), 7.0, dtype=dtype)
    before = receiver.clone()
    targets = [4, 0, 5, 2]
    released = []
    landing = LandingPages(targets, [receiver[:, :, page_id] for page_id in targets], released.append)
    reader = PoolReader()

    copied = asyncio.run(reader.copy(bundle, landing))
    assert [page.key for page in copied] == keys and [page.landing_page for page in copied] == targets
    assert all(page.kv is view for page, view in zip(copied, landing.views))
    for n, page_id in enumerate(targets):
        assert torch.equal(receiver[:, :, page_id], pool.kv[:, :, n])
    assert torch.equal(receiver[:, :, [1, 3]], before[:, :, [1, 3]])
    assert released == []  # the copy returned, but the fetch still holds them
    landing.drop()
    assert released == [landing]
    assert asyncio.run(reader.copy(bundle, landing))[0].landing_page is None  # released: tensors of its own

    index.withdraw(keys[2])  # reused since the answer: the run ends before it
    receiver.copy_(before)
    assert [page.key for page in reader.copy_pages(bundle, [receiver[:, :, page_id] for page_id in targets])] == \
        keys[:2]
    index.publish(keys[2], 2, (2,))
    bundle = pool.bundle(keys, [(n,) for n in range(4)], list(range(4)), pool.generations[:4].tolist())
    other_dtype = torch.zeros((2, 2, 6, 8, 1, 4), dtype=torch.float16)
    other_shape = torch.zeros((2, 2, 6, 4, 1, 4), dtype=dtype)  # half the page size
    for out in ([other_dtype[:, :, page_id] for page_id in targets],
                [other_shape[:, :, page_id] for page_id in targets],
                [receiver[:, :, page_id] for page_id in targets[:3]]):
        landing = LandingPages(targets[: len(out)], out, released.append)
        copied = asyncio.run(reader.copy(bundle, landing))
        assert [page.key for page in copied] == keys and all(page.landing_page is None for page in copied)
        assert all(torch.equal(page.kv, pool.kv[:, :, n]) for n, page in enumerate(copied))
    assert not other_dtype.any() and not other_shape.any()
    pool.close()
