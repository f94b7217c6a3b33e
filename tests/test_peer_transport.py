"""Peer copy between two replica processes, through the replica's own export / release methods and ServePeerClient.

The two ``ServeReplica``s run in separate processes (spawned), joined by a pipe that stands in for the Serve handle
(the same ``export_pages.remote`` / ``release_pages.remote`` calls). On the CPU the receiver copies the pages straight
out of the holder's shared pool, or, when it does not name its node (as across nodes), they travel as a host bundle;
on a CUDA machine the holder answers a CUDA IPC bundle and the receiver copies device to device (these cases are
skipped without a GPU; benchmarks/gpu_check.py runs them on the lent GPU machine, and also over real Ray actors).

Checked: the receiver's greedy tokens equal transformers' ``generate`` on the same weights, the prefix is counted as
``peer`` tokens, the copied pages are bit-identical to the holder's, the transport used, and that the holder's lease
is released after the copy.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time

import pytest
import torch

from replica.config import EngineConfig
from replica.cuda_ipc import CudaIpcBundle, CudaIpcHandle, IpcTarget
from common.types import EngineRequest
from common.types import CacheSource
from replica.page_record import PageRecord
from replica.peer_copy import (PeerExportRequest, ServePeerClient, bundle_pages,
                               unbundle_pages)
from common.types import SamplingParams
from test_kv_sources import CountingWrites, reserved_pages

PAGE_SIZE = 128
NUM_OUT = 8
TRANSPORTS = [  # (devices, transport)
    ("cpu", "shared_memory"),
    ("cpu", "host"),
    pytest.param("gpu", "cuda_ipc", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


def engine_config(model_dir: str, devices: str, replica_id: str, **overrides) -> EngineConfig:
    return EngineConfig(model=model_dir, devices=devices, dtype="float32", num_pages=32, max_num_batched_tokens=1024,
                        replica_id=replica_id, **overrides)


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (length,), generator=generator).tolist()


async def ask(replica, tokens: list[int], request_id: str, peer_hint: str | None = None):
    """Greedy tokens and the final output's cached-token breakdown."""
    out, last = [], None
    request = EngineRequest(request_id, tokens, SamplingParams(max_tokens=NUM_OUT, temperature=0.0, ignore_eos=True),
                            peer_hint=peer_hint)
    async for output in replica.generate(request):
        out.extend(output.new_token_ids)
        last = output
    return out, last.cached_tokens.as_dict()


def holder_main(conn, model_dir: str, devices: str) -> None:
    """The holder replica's process: answers (operation, argument) messages until "stop"."""
    from replica.serve_replica import ServeReplica
    from replica.shared_pool import node_id

    torch.set_num_threads(1)
    # eager: the holder only computes the prefix (its pages are compared bit for bit with the receiver's copies, whose
    # forward is the compiled default); a compile would cost each spawned holder ~10 s on a slow CI box
    replica = ServeReplica(engine_config(model_dir, devices, "holder", enforce_eager=True), "tiny")
    loop = asyncio.new_event_loop()
    operations = {
        "generate": lambda tokens: loop.run_until_complete(ask(replica, tokens, "holder-request")),
        "export_pages": lambda request: loop.run_until_complete(replica.export_pages(request)),
        "release_pages": lambda request: loop.run_until_complete(replica.release_pages(request)),
        "read_pages": lambda keys: [(page.key, page.token_ids, page.kv) for page in
                                    loop.run_until_complete(replica.engine.export_pages(keys))],
        "num_leases": lambda _: None if replica.ipc_exporter is None else replica.ipc_exporter.num_leases,
        "node_id": lambda _: node_id(),
    }
    while True:
        operation, argument = conn.recv()
        if operation == "stop":
            break
        try:
            conn.send(("ok", operations[operation](argument)))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            conn.send(("error", repr(exc)))
    replica.engine.shutdown()


class PipeHandle:
    """The holder's process as a handle: ``handle.export_pages.remote(request)`` is awaitable, like Serve's."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.calls: list[str] = []

    def call(self, operation: str, argument=None):
        with self.lock:
            self.calls.append(operation)
            self.conn.send((operation, argument))
            status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"holder failed {operation}: {value}")
        return value

    def __getattr__(self, operation: str):
        handle = self

        class Method:
            @staticmethod
            def remote(argument):
                # like a Ray call, it runs whether or not the caller awaits it
                return asyncio.ensure_future(asyncio.to_thread(handle.call, operation, argument))

        return Method


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None

    @torch.inference_mode()
    def generate(tokens: list[int]) -> list[int]:
        out = model.generate(torch.tensor([tokens]), max_new_tokens=NUM_OUT, do_sample=False, pad_token_id=0)
        return out[0, len(tokens):].tolist()

    return generate


@pytest.mark.parametrize("devices,transport", TRANSPORTS)
def test_prefix_copied_from_a_replica_in_another_process(tiny_llama_dir, reference_tokens, devices, transport):
    from replica.serve_replica import ServeReplica

    context = multiprocessing.get_context("spawn")
    parent_conn, child_conn = context.Pipe()
    holder = context.Process(target=holder_main, args=(child_conn, tiny_llama_dir, devices), daemon=True)
    holder.start()
    handle = PipeHandle(parent_conn)
    device = "cuda" if devices == "gpu" else "cpu"
    client = ServePeerClient("unused", "unused", timeout_s=120, device=device, handle=handle)
    if transport == "host":
        client.node_id = None  # as a receiver on another node asks
    elif devices == "cpu":  # the node as the holder names it (this test session may run Ray, the holder does not)
        client.node_id = handle.call("node_id")
    receiver = ServeReplica(engine_config(tiny_llama_dir, devices, "receiver"), "tiny", peer_client=client)
    try:
        prefix = prompt(3 * PAGE_SIZE + 20, seed=1)
        first, second = prefix + prompt(30, seed=2), prefix + prompt(25, seed=3)
        handle.call("generate", first)
        tokens, cached = asyncio.run(ask(receiver, second, "receiver-request", peer_hint="holder"))

        assert tokens == reference_tokens(second)
        assert cached == {"local": 0, "peer": 3 * PAGE_SIZE, "host": 0, "disk": 0}
        assert client.transport_stats.pages == {"cuda_ipc": 0, "shared_memory": 0, "host": 0, "tcp": 0, transport: 3}
        assert client.transport_stats.ipc_failures == client.transport_stats.shared_memory_failures == 0

        if transport == "shared_memory":  # the next fetch from this holder asks over its socket, not the handle
            exports = handle.calls.count("export_pages")
            other = prompt(2 * PAGE_SIZE + 9, seed=4)
            handle.call("generate", other + prompt(11, seed=5))
            third = other + prompt(13, seed=6)
            engine = receiver.engine.engine  # and copies into pool pages it reserved (landing pages), none after
            writes, reservations = CountingWrites(engine.runner), reserved_pages(receiver.engine)
            tokens, cached = asyncio.run(ask(receiver, third, "receiver-request-2", peer_hint="holder"))
            assert tokens == reference_tokens(third)
            assert cached == {"local": 0, "peer": 2 * PAGE_SIZE, "host": 0, "disk": 0}
            assert writes.page_ids == [] and len(reservations) == 1 and len(reservations[0]) == 2
            assert [engine.kv.cache.lookup(key) for key in engine.page_keys(third)[:2]] == reservations[0]
            assert handle.calls.count("export_pages") == exports
            assert client.transport_stats.socket_exports >= 1 and client.transport_stats.socket_failures == 0
            assert client.transport_stats.pages["shared_memory"] == 5

        keys = receiver.engine.engine.page_keys(second)[:3]
        held = handle.call("read_pages", keys)
        copied = asyncio.run(receiver.engine.export_pages(keys))
        assert [page.key for page in copied] == [key for key, _, _ in held] == keys
        assert all(torch.equal(mine.kv, theirs) for mine, (_, _, theirs) in zip(copied, held))

        if devices == "gpu":  # the release is fire and forget: the lease goes soon after the copy
            deadline = time.monotonic() + 10
            while handle.call("num_leases") != 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert handle.call("num_leases") == 0
            assert handle.calls.count("release_pages") == 1
    finally:
        receiver.engine.shutdown()
        parent_conn.send(("stop", None))
        holder.join(timeout=60)
        if holder.is_alive():
            holder.kill()


class CpuHolderOfferingIpc:
    """A handle whose holder answers a CUDA IPC bundle this process cannot open, then (asked again) a host bundle."""

    def __init__(self, pages) -> None:
        self.pages = pages
        self.requests: list[PeerExportRequest] = []
        self.released: list[str] = []
        outer = self

        class Export:
            @staticmethod
            def remote(request):
                outer.requests.append(request)
                return outer._answer(request)

        class Release:
            @staticmethod
            def remote(request):
                outer.released.append(request.lease_id)
                return outer._released()

        self.export_pages, self.release_pages = Export, Release

    async def _released(self) -> bool:
        return True

    async def _answer(self, request):
        if request.ipc_target is None:
            return bundle_pages(self.pages)
        handle = CudaIpcHandle(b"\0" * 64, 0, 0, b"", 0, None, False)
        return CudaIpcBundle([page.key for page in self.pages], [list(page.token_ids) for page in self.pages], "lease-1",
                             "GPU-not-visible-here", handle, (len(self.pages), 1), "float32")


def test_unopenable_ipc_bundle_falls_back_to_a_host_copy():
    pages = [PageRecord(bytes([index]) * 32, tuple(range(index, index + 4)), torch.full((2, 2, 4, 1, 2), float(index)))
             for index in range(3)]
    handle = CpuHolderOfferingIpc(pages)
    client = ServePeerClient("unused", "unused", handle=handle)
    assert client.ipc_target is None  # a CPU replica never offers CUDA IPC
    client.ipc_target = IpcTarget("some-host", ("GPU-elsewhere",))  # as a GPU replica would

    got = asyncio.run(client.fetch("holder", [page.key for page in pages]))

    assert [request.ipc_target for request in handle.requests] == [client.ipc_target, None]
    assert handle.released == ["lease-1"]  # the holder's staging memory is not left pinned
    assert [(page.key, page.token_ids) for page in got] == [(page.key, page.token_ids) for page in pages]
    assert all(torch.equal(page.kv, expected.kv) for page, expected in zip(got, pages))
    assert {page.source for page in got} == {CacheSource.PEER}
    assert client.transport_stats.pages == {"cuda_ipc": 0, "shared_memory": 0, "host": 3, "tcp": 0}
    assert client.transport_stats.ipc_failures == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_contiguous_export_is_the_bundle_itself_and_round_trips_bit_exact(dtype):
    """Pages exported as the leading slots of one tensor travel without a second copy; any other pages are stacked
    (one copy)."""
    stacked = torch.randn(3, 2, 2, 4, 1, 2).to(dtype)
    pages = [PageRecord(bytes([index + 1]) * 32, (index,), stacked[index]) for index in range(3)]
    bundle = bundle_pages(pages)
    assert bundle.kv.ctypes.data == stacked.data_ptr() and bundle.dtype == str(dtype).removeprefix("torch.")

    assert bundle_pages(pages[:2]).kv.ctypes.data == stacked.data_ptr()  # the leading slots (a reused buffer's way)
    for subset in (pages[1:], [pages[0], pages[2]]):  # not slots 0, 1, ... in order: copied
        assert bundle_pages(subset).kv.ctypes.data != stacked.data_ptr()
    for subset in (pages[:2], pages[1:], [pages[0], pages[2]]):  # the same bits either way
        got = unbundle_pages(bundle_pages(subset))
        assert all(torch.equal(page.kv.view(torch.uint8), want.kv.view(torch.uint8)) for page, want in zip(got, subset))
    got = unbundle_pages(bundle)
    assert [page.key for page in got] == [page.key for page in pages]
    assert all(torch.equal(page.kv.view(torch.uint8), want.kv.view(torch.uint8)) for page, want in zip(got, pages))


def test_a_cuda_ipc_export_and_release_wait_for_the_device_off_the_event_loop():
    """The holder's CUDA IPC export synchronizes with the device and its release collects IPC references: both run
    on a worker thread, so the replica's event loop (its other requests' streams) does not wait for the GPU."""
    from types import SimpleNamespace

    from replica.cuda_ipc import PeerRelease
    from replica.serve_replica import ServeReplica

    threads: dict[str, int] = {}
    page = PageRecord(b"k" * 32, (1, 2, 3), torch.zeros(2, 2, 4, 1, 2))

    class Exporter:
        def can_serve(self, target):
            return True

        def export(self, pages):
            threads["export"] = threading.get_ident()
            return ("bundle", len(pages))

        def release(self, lease_id):
            threads["release"] = threading.get_ident()
            return lease_id == "lease-1"

    async def export_pages(keys, to_cpu=True):
        assert not to_cpu  # device pages
        return [page]

    replica = SimpleNamespace(replica_id="holder", ipc_exporter=Exporter(),
                              engine=SimpleNamespace(export_pages=export_pages))
    request = PeerExportRequest("holder", [page.key], ipc_target=IpcTarget("host", ("GPU-0",)))

    async def scenario():
        threads["loop"] = threading.get_ident()
        bundle = await ServeReplica.export_pages(replica, request)
        released = await ServeReplica.release_pages(replica, PeerRelease("holder", "lease-1"))
        return bundle, released

    assert asyncio.run(scenario()) == (("bundle", 1), True)
    assert threads["export"] != threads["loop"] and threads["release"] != threads["loop"]
