"""Peer copy between nodes over a holder's page stream (replica/page_stream.py), without Ray.

Checked: pages sent straight out of the holder's shared pool arrive bit-equal to its own export, with their keys and
token ids, in both dtypes; a page withdrawn while it was sent is not valid, with the pages after it; both sides prove
the token (a peer without it is hung up on, and a listener that cannot prove it is refused); requests and answers out
of bounds are refused before they are read; the peer client learns the stream from a host bundle answered through the
handle, asks there next time, and goes back to the handle for a while when the stream fails. The path across two Ray
nodes is in tests/multinode_cases.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import struct
import threading

import pytest
import torch

from common import lane_protocol
from replica import page_stream
from replica.page_stream import StreamClient, StreamServer
from replica.peer_copy import ServePeerClient, bundle_pages
from replica.shared_pool import SharedPool
from test_shared_pool import PAGE, HolderOverHandle, prompt, run, tiny  # noqa: F401 - tiny: the engine fixture


def streaming_holder(tiny, *prompts: list[int]):
    """A holder engine whose shared pool serves a page stream on the loopback address: (engine, its pool)."""
    holder = tiny.engine(num_pages=8)
    pool = holder.runner.shared_pool
    pool.serve_stream(holder.share_pages, "127.0.0.1")
    for number, tokens in enumerate(prompts):
        run(holder, tokens, f"p{number}")
    return holder, pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_stream_out_of_the_pool_bit_exact_and_a_page_withdrawn_meanwhile_is_not_valid(dtype):
    pool = SharedPool((3, 2, 6, 8, 2, 4), dtype)  # layers, K/V, pages, page size, kv heads, head dim
    pool.kv.copy_(torch.randn(pool.kv.shape).to(dtype))
    keys = [bytes([n + 1]) * 32 for n in range(4)]
    page_ids = [4, 1, 5, 0]  # scattered over the pool
    token_ids = [list(range(8 * n, 8 * n + 8)) for n in range(4)]

    def answer(asked):
        held = 0
        while held < len(asked) and held < len(keys) and asked[held] == keys[held]:
            held += 1
        ids = page_ids[:held]
        return pool.bundle(keys[:held], token_ids[:held], ids, pool.generations[ids].tolist())

    pool.serve_stream(answer, "127.0.0.1")
    client = StreamClient(timeout_s=10)
    location = pool.stream_location
    assert location.host == "127.0.0.1" and "token" not in repr(location)

    found, tokens, arrays, wire_dtype = client.fetch(location, keys[:3] + [b"\x09" * 32])  # a key not held ends it
    pages = [torch.from_numpy(array).view(getattr(torch, wire_dtype)) for array in arrays]
    assert wire_dtype == str(dtype).removeprefix("torch.") and found == keys[:3] and tokens == token_ids[:3]
    assert len(pages) == 3 and all(torch.equal(pages[n], pool.kv[:, :, page_ids[n]]) for n in range(3))
    assert client.fetch(location, []) == ([], [], [], wire_dtype)
    assert len(pool.stream_server._connections) == 1  # one connection, kept between the calls

    def withdrawn_meanwhile(asked):  # page 2's key is withdrawn (its generation moves) before the page is sent
        bundle = answer(asked)
        pool.generations[bundle.page_ids[2]] += 1
        return bundle

    pool.stream_server.answer = withdrawn_meanwhile
    found, tokens, arrays, _dtype = client.fetch(location, keys)
    assert found == keys[:2] and tokens == token_ids[:2] and len(arrays) == 2
    pool.stream_server.answer = lambda asked: None  # the holder cannot answer: an error, never a wrong page
    with pytest.raises(ConnectionError, match="could not answer"):
        client.fetch(location, keys)
    pool.close()
    assert pool.stream_location is None
    with pytest.raises(OSError):
        client.fetch(location, keys)


def test_both_sides_prove_the_token_and_messages_out_of_bounds_are_refused(tiny):
    tokens = prompt(PAGE + 1, seed=32)
    holder, pool = streaming_holder(tiny, tokens)
    keys = holder.page_keys(tokens)
    location = pool.stream_location
    server = pool.stream_server

    with pytest.raises(ConnectionError):  # the holder hangs up on a peer that cannot prove the token
        StreamClient(timeout_s=10).fetch(dataclasses.replace(location, token=b"\x00" * 32), keys)
    assert server.num_refused == 1

    def raw_connection() -> socket.socket:
        sock = socket.create_connection((location.host, location.port), timeout=10)
        hello = page_stream._receive(sock, 4 + page_stream.NONCE_BYTES)
        nonce = b"\x05" * page_stream.NONCE_BYTES
        sock.sendall(nonce + lane_protocol.token_proof(location.token, b"peer", hello[4:], nonce))
        page_stream._receive(sock, 32)
        return sock

    def hung_up(sock: socket.socket) -> bool:
        """The holder closed the connection (a reset when bytes it did not read were left)."""
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:
            return True

    with raw_connection() as sock:  # too many keys: hung up on before any key is read
        sock.sendall(struct.pack("<4sI", b"PSXT", page_stream.MAX_KEYS + 1))
        assert hung_up(sock)
    with raw_connection() as sock:  # not a request at all
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert hung_up(sock)
    assert len(StreamClient(timeout_s=10).fetch(location, keys)[0]) == 1  # still serving

    # a listener that answers the hello but cannot prove the token is refused by the peer, and so is one that
    # answers more pages than were asked, or more tokens than its pages hold (before they are read)
    impostor = socket.socket()
    impostor.bind(("127.0.0.1", 0))
    impostor.listen(3)

    def impostor_holder():
        for mode in ("no proof", "more pages", "more tokens"):
            sock, _ = impostor.accept()
            with sock:
                nonce = b"\x09" * page_stream.NONCE_BYTES
                sock.sendall(b"PSXH" + nonce)
                reply = page_stream._receive(sock, 64)
                if mode == "no proof":
                    sock.sendall(b"\x00" * 32)
                    continue
                sock.sendall(lane_protocol.token_proof(location.token, b"holder", nonce, reply[:32]))
                page_stream._receive(sock, 8 + 32)
                num_pages, num_tokens = (2, 0) if mode == "more pages" else (1, 1000)  # pages of 1 token
                sock.sendall(struct.pack("<4sIIB5I", b"PSXP", num_pages, num_tokens, 0, 1, 2, 1, 1, 1))
                sock.recv(1)

    thread = threading.Thread(target=impostor_holder, daemon=True)
    thread.start()
    fake = dataclasses.replace(location, port=impostor.getsockname()[1])
    with pytest.raises(ConnectionError, match="could not prove"):
        StreamClient(timeout_s=10).fetch(fake, keys)
    with pytest.raises(ConnectionError, match="more pages than were asked"):
        StreamClient(timeout_s=10).fetch(fake, keys)
    with pytest.raises(ConnectionError, match="out of bounds"):  # more tokens than its pages hold, before reading
        StreamClient(timeout_s=10).fetch(fake, keys)
    thread.join(10)
    impostor.close()


class HostBundleHandle(HolderOverHandle):
    """A handle that answers ``export_pages`` as a CPU holder on another node does: a host bundle naming its stream."""

    def __init__(self, engine, pool) -> None:
        super().__init__(engine)
        self.pool = pool

    async def _answer(self, request):
        bundle = bundle_pages(self.engine.export_pages(list(request.keys), contiguous=True))
        stream = self.pool.stream_location
        return dataclasses.replace(bundle, stream=stream) if stream is not None else bundle


def test_a_peer_on_another_node_asks_the_holders_stream_after_one_copy_through_the_handle(tiny):
    first, second = prompt(2 * PAGE + 3, seed=33), prompt(PAGE + 9, seed=34)
    holder, pool = streaming_holder(tiny, first, second)
    handle = HostBundleHandle(holder, pool)
    client = ServePeerClient("unused", "unused", timeout_s=10, handle=handle)
    client.node_id = None  # as a receiver on another node: no shared-pool answers

    async def fetch(tokens):
        return await client.fetch("holder", holder.page_keys(tokens))

    async def scenario():
        got = [await fetch(first)]
        assert handle.calls == 1 and client.transport_stats.pages["host"] == 2
        got.append(await fetch(second))
        got.append(await fetch(first))
        assert handle.calls == 1 and client.transport_stats.stream_exports == 2
        assert client.transport_stats.pages["tcp"] == 1 + 2
        pool.stop_serving_exports()  # the holder's stream is gone: through the handle again, for a while
        got.append(await fetch(second))
        assert handle.calls == 2 and client.transport_stats.stream_failures == 1
        assert client.transport_stats.export_calls()["stream_failed"] == 1
        return got

    got = asyncio.run(scenario())
    client.close()
    for tokens, pages in zip((first, second, first, second), got):
        want = holder.export_pages(holder.page_keys(tokens))
        assert [(page.key, page.token_ids) for page in pages] == [(page.key, page.token_ids) for page in want]
        assert all(torch.equal(mine.kv, theirs.kv) for mine, theirs in zip(pages, want))


def test_a_replica_serves_its_stream_inside_ray_unless_told_not_to_and_a_taken_address_is_only_logged(
        tiny, monkeypatch, caplog):
    from replica import async_engine
    from replica.async_engine import AsyncEngine

    monkeypatch.setattr(async_engine, "node_address", lambda: None)  # outside Ray: no address to offer
    engine = AsyncEngine(tiny.engine(num_pages=8), None)
    assert engine.stream_location is None
    engine.shutdown()
    monkeypatch.setattr(async_engine, "node_address", lambda: "127.0.0.1")  # inside Ray: the node's address
    engine = AsyncEngine(tiny.engine(num_pages=8), None)
    assert engine.stream_location.host == "127.0.0.1" and engine.stream_location.port > 0
    engine.shutdown()
    assert engine.stream_location is None  # closed with the engine
    engine = AsyncEngine(tiny.engine(num_pages=8, peer_copy_stream=False), None)  # --no-peer-copy-stream
    assert engine.stream_location is None
    engine.shutdown()

    holder = tiny.engine(num_pages=8)
    pool = holder.runner.shared_pool
    pool.serve_stream(holder.share_pages, "192.0.2.1")  # TEST-NET-1: not this machine's, the bind fails
    assert pool.stream_location is None and "no page stream" in caplog.text
    with pytest.raises(ValueError):
        StreamServer(holder.share_pages, pool.kv[0], pool.generations, "127.0.0.1")  # not a pool's shape


def test_the_stream_flag_reaches_the_replicas():
    from cluster.cli import build_parser, config_from_args

    for argv, expected in (([], True), (["--no-peer-copy-stream"], False)):
        config = config_from_args(build_parser().parse_args(["serve", "--model", "m", *argv]))
        assert config.peer_copy_stream is expected and config.engine_config("r").peer_copy_stream is expected


def test_receive_slots_are_reused_only_once_nothing_refers_to_the_page_received_into_them():
    import gc

    from replica.page_stream import PageSlots

    slots = PageSlots(max_bytes=3 * 64)
    first = torch.from_numpy(slots.take((4, 4), "<f4"))  # 64 bytes: as the client hands a page to the engine
    view = first.view(torch.int32)[1:]  # a view keeps the slot taken, as the engine's or a tier's reference does
    second = slots.take((4, 4), "<f4")
    assert second.ctypes.data != first.data_ptr()
    address = first.data_ptr()
    del first
    gc.collect()
    assert all(slots.take((4, 4), "<f4").ctypes.data != address for _ in range(2))  # still viewed
    del view
    gc.collect()
    again = slots.take((4, 4), "<f4")
    assert again.ctypes.data == address  # back once the last view went
    beyond = [slots.take((4, 4), "<f4") for _ in range(3)]  # over max_bytes: plain arrays, never kept
    assert slots._kept_bytes == 3 * 64 and all(page.shape == (4, 4) for page in beyond)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_peer_on_another_node_receives_pages_straight_into_its_pool_pages(tiny, dtype):
    """Landing pages (replica/landing.py) across nodes: the page stream's bytes are received into the receiver's pool
    pages run by run; each record is the page it wrote and names it; no other byte of the receiver's pool changes;
    pages of another shape or dtype get slots of their own instead."""
    from replica.landing import LandingPages

    pool = SharedPool((3, 2, 6, 8, 2, 4), dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape).to(dtype))
    keys = [bytes([n + 1]) * 32 for n in range(3)]
    page_ids = [4, 1, 5]

    def answer(asked):
        held = [key for key, _ in zip(keys, asked)]
        ids = page_ids[:len(held)]
        return pool.bundle(held, [[n] for n in range(len(held))], ids, pool.generations[ids].tolist())

    pool.serve_stream(answer, "127.0.0.1")
    client = StreamClient(timeout_s=10)
    receiver = torch.full((3, 2, 7, 8, 2, 4), 5.0, dtype=dtype)
    before = receiver.clone()
    targets = [6, 0, 3]
    views = [receiver[:, :, page_id] for page_id in targets]
    found, _tokens, pages, _dtype = client.fetch(pool.stream_location, keys, views)
    assert found == keys and all(page is view for page, view in zip(pages, views))
    for n, page_id in enumerate(targets):
        assert torch.equal(receiver[:, :, page_id], pool.kv[:, :, page_ids[n]])
    assert torch.equal(receiver[:, :, [1, 2, 4, 5]], before[:, :, [1, 2, 4, 5]])

    other_dtype = torch.zeros((3, 2, 7, 8, 2, 4), dtype=torch.float16)
    other_shape = torch.zeros((3, 2, 7, 8, 1, 4), dtype=dtype)  # one KV head instead of two
    for other in (other_dtype, other_shape):
        _found, _tokens, pages, _dtype = client.fetch(pool.stream_location, keys, [other[:, :, n] for n in targets])
        assert len(pages) == 3 and all(not isinstance(page, torch.Tensor) for page in pages) and not other.any()

    # through the peer client: the records name the landing pages; released only once the fetch drops them
    holder, holder_pool = streaming_holder(tiny, prompt(2 * PAGE + 3, seed=41))
    peer = ServePeerClient("unused", "unused", timeout_s=10, handle=HostBundleHandle(holder, holder_pool))
    peer.node_id = None
    holder_keys = holder.page_keys(prompt(2 * PAGE + 3, seed=41))
    pool_kv = torch.zeros((holder.runner.kv_cache.shape[0], 2, 4, *holder.runner.kv_cache.shape[3:]),
                          dtype=holder.runner.kv_cache.dtype)
    released = []
    landing = LandingPages([2, 0], [pool_kv[:, :, 2], pool_kv[:, :, 0]], released.append)

    async def scenario():
        await peer.fetch("holder", holder_keys)  # learns the stream through the handle
        assert peer.copies_into_pool("holder")
        return await peer.fetch("holder", holder_keys, landing)

    got = asyncio.run(scenario())
    assert [page.landing_page for page in got] == [2, 0] and peer.transport_stats.pages["tcp"] == 2
    want = holder.export_pages(holder_keys)
    assert all(torch.equal(page.kv, theirs.kv) and page.kv is view for page, theirs, view in
               zip(got, want, landing.views))
    assert released == []
    landing.drop()
    assert released == [landing]
    peer.close()
    pool.close()


def test_a_peer_on_another_node_asks_the_stream_the_router_named_from_its_first_copy(tiny, monkeypatch):
    """``ServePeerClient.learn_stream``: the router's hint names the holder's stream (its routing stats), so the first
    copy from a holder on another node skips Ray's handle and object store. Not learned: for a holder on this node
    (its shared memory is faster), with streams off, or within SOCKET_RETRY_S of a failed stream."""
    from replica import peer_copy
    from replica.shared_pool import node_id

    tokens = prompt(2 * PAGE + 3, seed=35)
    holder, pool = streaming_holder(tiny, tokens)
    handle = HostBundleHandle(holder, pool)
    location = pool.stream_location
    assert location.node == node_id()
    same_node = ServePeerClient("unused", "unused", timeout_s=10, handle=handle)
    assert not same_node.learn_stream("holder", location) and not same_node.copies_into_pool("holder")
    same_node.close()
    client = ServePeerClient("unused", "unused", timeout_s=10, handle=handle)
    client.node_id = None  # as a receiver on another node
    client.use_streams = False  # --no-peer-copy-stream
    assert not client.learn_stream("holder", location)
    client.use_streams = True
    assert client.learn_stream("holder", location) and client.copies_into_pool("holder")
    assert not client.learn_stream("holder", location)  # known already
    client.stream_client.executor.submit(lambda: None).result(10)  # the connection it opened on learning it
    assert len(client.stream_client._idle[location]) == 1 and len(pool.stream_server._connections) == 1
    keys = holder.page_keys(tokens)

    async def fetch():
        return await client.fetch("holder", keys)

    got = asyncio.run(fetch())
    assert handle.calls == 0 and client.transport_stats.pages["tcp"] == 2 and client.transport_stats.pages["host"] == 0
    assert len(pool.stream_server._connections) == 1  # the copy took that connection
    want = holder.export_pages(keys)
    assert [(page.key, page.token_ids) for page in got] == [(page.key, page.token_ids) for page in want]
    assert all(torch.equal(mine.kv, theirs.kv) for mine, theirs in zip(got, want))

    pool.stop_serving_exports()  # the stream is gone: through the handle, and the router's word is not taken again
    asyncio.run(fetch())
    assert handle.calls == 1 and client.transport_stats.stream_failures == 1
    assert not client.learn_stream("holder", location)
    monkeypatch.setattr(peer_copy, "SOCKET_RETRY_S", 0.0)  # once the interval is over, it is
    assert client.learn_stream("holder", location)
    client.close()


def receiver_on_another_node(tiny, holder, pool):
    """(the holder's handle, the receiver's peer client, the receiver "B"): an AsyncEngine whose peer client asks the
    holder as a replica on another node does (host bundles through the handle, or the holder's stream)."""
    from replica.async_engine import AsyncEngine
    from replica.kv_sources import PrefixFetcher, page_format_of

    handle = HostBundleHandle(holder, pool)
    client = ServePeerClient("unused", "unused", timeout_s=10, handle=handle)
    client.node_id = None
    engine = tiny.engine(num_pages=8, replica_id="B")
    return handle, client, AsyncEngine(engine, PrefixFetcher(page_format_of(engine), peer_client=client,
                                                             own_replica_id="B"))


def test_a_request_naming_the_holders_stream_is_served_over_it_with_the_reference_tokens(tiny):
    """End to end in one process: an ``EngineRequest`` whose peer_hint comes with the holder's stream (as the router
    sends it) reuses the prefix from that holder on another node without any call through the handle, and gives
    transformers' greedy tokens; the same request without the stream asks through the handle first."""
    from common.types import CacheSource, EngineRequest, SamplingParams

    prefix = prompt(2 * PAGE + 3, seed=36)
    holder, pool = streaming_holder(tiny, prefix)
    question = prefix + prompt(20, seed=37)
    expected = tiny.generate(question, 4)
    results = {}
    for with_stream in (True, False):
        handle, client, receiver = receiver_on_another_node(tiny, holder, pool)
        request = EngineRequest("q", question, SamplingParams(max_tokens=4, temperature=0.0), peer_hint="holder",
                                peer_stream=pool.stream_location if with_stream else None)

        async def ask():
            tokens, last = [], None
            async for out in receiver.generate(request):
                tokens.extend(out.new_token_ids)
                last = out
            return tokens, last.cached_tokens

        try:
            tokens, cached = asyncio.run(ask())
        finally:
            receiver.shutdown()
            client.close()
        results[with_stream] = (handle.calls, client.transport_stats.pages["tcp"], client.transport_stats.pages["host"])
        assert tokens == expected and cached.as_dict()[CacheSource.PEER.value] == 2 * PAGE
    assert results[True] == (0, 2, 0)
    assert results[False] == (1, 0, 2)


def test_a_hot_prefix_copy_naming_the_holders_stream_skips_the_handle(tiny):
    """``PrefetchRequest.peer_stream`` (the router fills it as for a request): the target on another node copies the
    prefix over the holder's stream from its first copy on; without it, through the handle."""
    from common.types import PrefetchRequest

    prefix = prompt(2 * PAGE + 3, seed=38)
    holder, pool = streaming_holder(tiny, prefix)
    results = {}
    for with_stream in (True, False):
        handle, client, target = receiver_on_another_node(tiny, holder, pool)
        copy = PrefetchRequest("c", "B", "holder", prefix, 2,
                               peer_stream=pool.stream_location if with_stream else None)
        try:
            result = asyncio.run(target.prefetch_prefix(copy))
        finally:
            target.shutdown()
            client.close()
        assert result.error is None and result.num_pages_copied == 2
        results[with_stream] = (handle.calls, client.transport_stats.pages["tcp"], client.transport_stats.pages["host"])
    assert results[True] == (0, 2, 0)
    assert results[False] == (1, 0, 2)


def test_a_new_connection_opens_with_the_receive_buffer_set_and_a_small_kernel_limit_leaves_it_to_the_kernel(
        tiny, tmp_path):
    """The receiver sets its socket's receive buffer before it connects (the first answer of a connection is then as
    fast as later ones; BENCHMARKS.md 0zi), capped at the kernel's rmem_max; under 1 MiB, or unreadable, it leaves it
    to the kernel's autotuning. The pages come bit-exact either way."""
    limit = tmp_path / "rmem_max"
    for text, expected in (("33554432\n", page_stream.RECEIVE_BUFFER_BYTES), (str(2 << 20), 2 << 20),
                           ("212992", 0), ("junk", 0)):
        limit.write_text(text)
        assert page_stream.receive_buffer_bytes(str(limit)) == expected
    assert page_stream.receive_buffer_bytes(str(tmp_path / "absent")) == 0

    tokens = prompt(2 * PAGE + 3, seed=39)
    holder, pool = streaming_holder(tiny, tokens)
    keys = holder.page_keys(tokens)
    want = holder.export_pages(keys)
    default = socket.socket()
    kernel_default = default.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    default.close()
    for buffer_bytes in (1 << 20, 0):
        client = StreamClient(timeout_s=10)
        client.buffer_bytes = buffer_bytes
        sock = client._connection(pool.stream_location)
        size = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        assert size >= 2 * buffer_bytes if buffer_bytes else size <= max(kernel_default, 1 << 20)  # Linux doubles it
        client._release(pool.stream_location, sock)
        found, _tokens, pages, dtype = client.fetch(pool.stream_location, keys)
        assert found == keys
        assert all(torch.equal(torch.from_numpy(page).view(getattr(torch, dtype)), theirs.kv)
                   for page, theirs in zip(pages, want))
        client.close()
    with pytest.raises(OSError):
        page_stream.connect("127.0.0.1", 1, 2.0, 1 << 20)  # nothing listens there
    pool.stop_serving_exports()
