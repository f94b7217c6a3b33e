"""Request lanes (replica/request_lane.py, cluster/request_lanes.py, common/lane_protocol.py) over real loopback TCP,
with a stand-in engine: requests and outputs both ways, errors, "busy", cancellation, a broken lane, and who may
connect. No Ray cluster."""

from __future__ import annotations

import asyncio
import time
import struct
import types

import pytest

pytest.importorskip("ray.serve")

from ray.serve.exceptions import RequestCancelledError  # noqa: E402

from cluster.request_lanes import LaneLost, connect_lane  # noqa: E402
from common.errors import InvalidRequestError  # noqa: E402
from common.types import CachedTokens, EngineRequest, RequestOutput, StreamLocation  # noqa: E402
from common import lane_protocol  # noqa: E402
from common.lane_protocol import prove_to_holder  # noqa: E402
from replica.request_lane import LaneServer  # noqa: E402


def output(request_id: str, index: int, finished: bool) -> RequestOutput:
    return RequestOutput(request_id, [index], f"t{index}", finished, "length" if finished else None, 3, index + 1,
                         CachedTokens())


class StandInEngine:
    """``generate``: ``num_outputs`` outputs per request (a prompt of [0] fails as invalid, [1] waits after its
    first output until cancelled); records the requests and which were cancelled."""

    def __init__(self, num_outputs: int = 3) -> None:
        self.num_outputs = num_outputs
        self.requests: list[EngineRequest] = []
        self.cancelled: list[str] = []
        self.full = False
        self.capacity = 8
        self.running = 0

    def room(self) -> int:
        return 0 if self.full else self.capacity - self.running

    async def generate(self, request: EngineRequest):
        self.requests.append(request)
        if request.prompt_token_ids == [0]:
            raise InvalidRequestError("the prompt is too long")
        self.running += 1  # counted from the first step, as AsyncEngine.generate counts
        try:
            for index in range(self.num_outputs):
                await asyncio.sleep(0)
                yield output(request.request_id, index, index == self.num_outputs - 1)
                if request.prompt_token_ids == [1]:
                    await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.running -= 1


class HandleStream:
    """What ``through_handle`` answers in these tests: two outputs."""

    def __init__(self, request_id: str) -> None:
        self.outputs = [output(request_id, 0, False), output(request_id, 1, True)]

    async def __anext__(self):
        if not self.outputs:
            raise StopAsyncIteration
        return self.outputs.pop(0)

    def cancel(self) -> None:
        self.outputs = []


async def open_lane(engine: StandInEngine, lane_id: str = "lane-1"):
    server = LaneServer(engine.generate, engine.room, "127.0.0.1")
    location = await server.start()
    server.expect(lane_id)
    holder = asyncio.ensure_future(server.hold(lane_id))
    lane = await connect_lane("replica-a", location, lane_id, asyncio.ensure_future(asyncio.sleep(3600)))
    return server, lane, holder


async def until(condition, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def drain(stream) -> list[RequestOutput]:
    outputs = []
    while True:
        item = await stream.__anext__()
        outputs.append(item)
        if item.finished:
            return outputs


def test_requests_and_their_outputs_cross_one_lane_side_by_side():
    async def scenario():
        engine = StandInEngine()
        server, lane, holder = await open_lane(engine)
        done = []
        streams = [lane.generate(EngineRequest(f"r{index}", [5, 6, 7]),
                                 lambda answered, i=index: done.append((i, answered)),
                                 lambda: pytest.fail("not through the handle")) for index in range(2)]
        results = await asyncio.gather(*(drain(stream) for stream in streams))
        for index, outputs in enumerate(results):
            assert [o.new_text for o in outputs] == ["t0", "t1", "t2"]
            assert {o.request_id for o in outputs} == {f"r{index}"}
        assert sorted(done) == [(0, True), (1, True)] and lane.num_requests == 0
        assert server.num_requests == 2 and [r.request_id for r in engine.requests] == ["r0", "r1"]
        assert server.num_active == 0  # both ended
        lane.close()
        await asyncio.wait_for(holder, 5)  # the replica's Serve call ends with its lane

    asyncio.run(scenario())


def test_a_failed_request_raises_its_error_at_the_ingress():
    async def scenario():
        engine = StandInEngine()
        _, lane, _ = await open_lane(engine)
        done = []
        stream = lane.generate(EngineRequest("bad", [0]), done.append, lambda: None)
        with pytest.raises(InvalidRequestError, match="too long"):
            await stream.__anext__()
        assert done == [True]  # it ran there (only a "busy" did not)
        assert [o.new_text for o in await drain(lane.generate(EngineRequest("ok", [5]), lambda _: None,
                                                              lambda: None))] == ["t0", "t1", "t2"]
        lane.close()

    asyncio.run(scenario())


def test_a_full_replica_answers_busy_and_the_request_goes_through_the_handle():
    async def scenario():
        engine = StandInEngine()
        server, lane, _ = await open_lane(engine)
        engine.full = True
        events = []
        stream = lane.generate(EngineRequest("r1", [5]), lambda answered: events.append(f"done {answered}"),
                               lambda: events.append("handle") or HandleStream("r1"))
        outputs = await drain(stream)
        assert [o.new_text for o in outputs] == ["t0", "t1"]
        assert events == ["done False", "handle"]  # the lane's count ended (no answer) before the handle's began
        assert engine.requests == [] and server.num_busy == 1
        lane.close()

    asyncio.run(scenario())


def test_a_lane_that_breaks_fails_its_requests_with_lane_lost_and_cancels_them_on_the_replica():
    async def scenario():
        engine = StandInEngine()
        server, lane, holder = await open_lane(engine)
        stream = lane.generate(EngineRequest("slow", [1]), lambda _: None, lambda: None)
        assert (await stream.__anext__()).new_text == "t0"
        server.drop("lane-1")  # the replica closes it (its Serve call was cancelled)
        with pytest.raises(LaneLost):
            await asyncio.wait_for(stream.__anext__(), 5)
        assert lane.closed
        await asyncio.wait_for(holder, 5)
        await until(lambda: engine.cancelled)
        assert engine.cancelled == ["slow"]

    asyncio.run(scenario())


def test_only_the_token_holder_naming_an_expected_lane_gets_in():
    async def scenario():
        engine = StandInEngine()
        server = LaneServer(engine.generate, engine.room, "127.0.0.1")
        location = await server.start()
        server.expect("lane-1")
        wrong = StreamLocation(location.host, location.port, b"x" * 32)
        reader, writer = await asyncio.open_connection(location.host, location.port)
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await prove_to_holder(reader, writer, wrong.token)
        writer.close()
        assert server.num_refused == 1
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):  # a lane no Serve call expects
            lane = await connect_lane("replica-a", location, "lane-unknown", asyncio.ensure_future(asyncio.sleep(9)))
            await drain(lane.generate(EngineRequest("r", [5]), lambda _: None, lambda: None))
            raise AssertionError("unreachable: the server hangs up")

    asyncio.run(scenario())


def test_a_frame_over_the_bound_is_refused_before_it_is_read(monkeypatch):
    monkeypatch.setattr(lane_protocol, "MAX_FRAME_BYTES", 1 << 10)

    async def scenario():
        engine = StandInEngine()
        server = LaneServer(engine.generate, engine.room, "127.0.0.1")
        location = await server.start()
        server.expect("lane-1")
        lane = await connect_lane("replica-a", location, "lane-1", asyncio.ensure_future(asyncio.sleep(9)))
        lane._writer.write(struct.pack("<I", 1 << 20))  # a header announcing 1 MiB, and nothing after it
        with pytest.raises(LaneLost):
            await asyncio.wait_for(drain(lane.generate(EngineRequest("r", [5]), lambda _: None, lambda: None)), 5)
        assert engine.requests == []

    asyncio.run(scenario())


def test_hold_ends_when_the_lane_never_connects():
    async def scenario():
        server = LaneServer(StandInEngine().generate, lambda: 8, "127.0.0.1")
        await server.start()
        server.expect("lane-1")
        await asyncio.wait_for(server.hold("lane-1", connect_wait_s=0.05), 5)
        server.drop("lane-1")
        await asyncio.wait_for(server.hold("lane-1"), 1)  # forgotten: nothing to hold
        server.close()

    asyncio.run(scenario())


class StandInRouter:
    """What ``RequestLanes`` asks of this process's router: its replicas, and a choice (always the first)."""

    def __init__(self, replica_ids: list[str]) -> None:
        self.ids = replica_ids
        self.done: list[str] = []

    def replica_ids(self) -> list[str]:
        return list(self.ids)

    async def route_for_lane(self, request):
        return self.ids[0], request, lambda answered=True: self.done.append(request.request_id)


class StandInReplicas:
    """The replica deployment's handle as ``RequestLanes`` uses it: ``request_lane.remote(LaneOpen)`` runs
    ``ServeReplica.request_lane``'s steps against a real ``LaneServer`` per replica."""

    def __init__(self, servers: dict[str, LaneServer]) -> None:
        self.deployment_id = types.SimpleNamespace(app_name="lanes-test", name="replicas")
        self.servers = servers
        self.ended: list[str] = []
        self.refuse: list[BaseException] = []
        """Errors the next open calls raise (as Serve's handle would), first one first."""

    @property
    def request_lane(self):
        return self

    def remote(self, lane_open):
        server = self.servers[lane_open.target_replica]

        refusal = self.refuse.pop(0) if self.refuse else None

        async def call():
            if refusal is not None:
                raise refusal
            server.expect(lane_open.lane_id)
            try:
                yield server.location
                await server.hold(lane_open.lane_id)
            finally:
                server.drop(lane_open.lane_id)
                self.ended.append(lane_open.target_replica)

        return call()


async def ingress_over_one_replica():
    """A real ``LaneServer`` for replica "a" over a stand-in engine, and the ingress's ``RequestLanes`` over a
    stand-in handle to it (``StandInReplicas``); no router registered yet."""
    from cluster import request_lanes

    engine = StandInEngine()
    server = LaneServer(engine.generate, engine.room, "127.0.0.1")
    await server.start()
    replicas = StandInReplicas({"a": server})
    return engine, server, replicas, request_lanes.RequestLanes(replicas, lambda handle: handle)


def test_the_ingress_takes_a_lane_once_open_and_the_handle_otherwise_and_closes_a_lane_whose_replica_left(
        monkeypatch):
    from cluster import request_lanes
    from router import local_routers

    monkeypatch.setattr(request_lanes, "WATCH_PERIOD_S", 0.02)

    async def scenario():
        engine, server, replicas, lanes = await ingress_over_one_replica()
        handle_calls = []

        avoided = []

        def through_handle(request):
            handle_calls.append(request.request_id)
            avoided.append(request.avoid_replica)
            return HandleStream(request.request_id)

        assert isinstance(await lanes.open_stream(EngineRequest("r0", [5]), through_handle), HandleStream)
        router = StandInRouter(["a"])
        local_routers.register("lanes-test", "replicas", router)
        first = await lanes.open_stream(EngineRequest("r1", [5]), through_handle)  # opens the lane meanwhile
        assert isinstance(first, HandleStream)
        await until(lambda: "a" in lanes._lanes)
        stream = await lanes.open_stream(EngineRequest("r2", [5]), through_handle)
        assert [o.new_text for o in await drain(stream)] == ["t0", "t1", "t2"]
        assert router.done == ["r2"] and [r.request_id for r in engine.requests] == ["r2"]
        pinned = EngineRequest("r3", [5], target_replica="a")
        assert isinstance(await lanes.open_stream(pinned, through_handle), HandleStream)
        assert handle_calls == ["r0", "r1", "r3"]
        engine.full = True  # "busy": on through the handle, naming the busy replica for the router to avoid
        assert [o.new_text for o in await drain(await lanes.open_stream(EngineRequest("r4", [5]), through_handle))]
        assert handle_calls[-1] == "r4" and avoided == [None, None, None, "a"] and router.done[-1] == "r4"
        engine.full = False
        router.ids = []  # the replica left: its lane closes, which ends its Serve call on the replica
        await until(lambda: replicas.ended)
        assert replicas.ended == ["a"] and not lanes._lanes
        lanes.close()
        server.close()

    asyncio.run(scenario())


def test_a_lane_open_refused_by_a_full_handle_queue_is_tried_again_soon_and_another_failure_later(monkeypatch):
    """A burst before the lanes opened can fill Serve's handle queue, which refuses the lane's own open call
    (``BackPressureError``): that open is tried again after ``RETRY_BUSY_S``, any other failure after ``RETRY_S``."""
    from ray.serve.exceptions import BackPressureError

    from cluster import request_lanes
    from router import local_routers

    monkeypatch.setattr(request_lanes, "RETRY_BUSY_S", 0.05)

    async def scenario():
        _, server, replicas, lanes = await ingress_over_one_replica()
        replicas.refuse = [BackPressureError(num_queued_requests=2, max_queued_requests=2),
                           RuntimeError("the replica is gone")]
        router = StandInRouter(["a"])  # registered by weak reference: held here
        local_routers.register("lanes-test", "replicas", router)

        def through_handle(request):
            return HandleStream(request.request_id)

        async def refused_and_retried_after(request_id: str) -> float:
            before = time.monotonic()
            await lanes.open_stream(EngineRequest(request_id, [5]), through_handle)  # opens in the background
            await until(lambda: not lanes._opening and "a" in lanes._retry_at)
            return lanes._retry_at["a"] - before

        assert 0 < await refused_and_retried_after("r0") <= 0.05 + 1.0
        await asyncio.sleep(0.1)
        assert await refused_and_retried_after("r1") > request_lanes.RETRY_S - 1
        lanes._retry_at.clear()
        await lanes.open_stream(EngineRequest("r2", [5]), through_handle)
        await until(lambda: "a" in lanes._lanes)  # the third try opens it
        lanes.close()
        server.close()

    asyncio.run(scenario())


def test_a_burst_is_admitted_only_up_to_the_replicas_room_and_the_rest_goes_through_the_handle():
    async def scenario():
        engine = StandInEngine()
        engine.capacity = 2
        server, lane, _ = await open_lane(engine)
        handle_calls = []

        def through_handle(request_id):
            handle_calls.append(request_id)
            return HandleStream(request_id)

        # six frames sent in one pass of the loop leave in one write and are read in one go by the replica
        streams = [lane.generate(EngineRequest(f"r{index}", [1]), lambda _: None,
                                 lambda i=index: through_handle(f"r{i}")) for index in range(6)]
        firsts = await asyncio.gather(*(stream.__anext__() for stream in streams))
        assert [o.request_id for o in firsts] == [f"r{index}" for index in range(6)]
        assert len(engine.requests) == 2 and server.num_busy == 4 and len(handle_calls) == 4
        for stream in streams:
            stream.cancel()
        lane.close()

    asyncio.run(scenario())


def test_a_cancelled_request_stops_counting_at_once_and_stops_on_the_replica():
    async def scenario():
        engine = StandInEngine()
        _, lane, _ = await open_lane(engine)
        done = []
        stream = lane.generate(EngineRequest("slow", [1]), done.append, lambda: None)
        assert (await stream.__anext__()).new_text == "t0"
        stream.cancel()  # a client gone away reads the stream no more: it ends here
        assert done == [True] and lane.num_requests == 0
        with pytest.raises(RequestCancelledError):  # a deadline's reader gets the cut
            await stream.__anext__()
        await until(lambda: engine.cancelled)
        assert engine.cancelled == ["slow"]
        lane.close()

    asyncio.run(scenario())


def test_a_request_cancelled_after_its_replica_answered_busy_is_not_sent_through_the_handle():
    async def scenario():
        engine = StandInEngine()
        _, lane, _ = await open_lane(engine)
        engine.full = True
        handle_calls = []
        stream = lane.generate(EngineRequest("r1", [5]), lambda _: None, lambda: handle_calls.append(1))
        await until(lambda: not stream._queue.empty())  # "busy" has arrived and waits in the stream's queue
        stream.cancel()  # e.g. the deadline
        with pytest.raises(RequestCancelledError):
            await stream.__anext__()
        assert handle_calls == []
        lane.close()

    asyncio.run(scenario())


def test_a_replica_full_with_lane_requests_refuses_one_more_through_the_handle_with_a_429():
    """Serve's limit on a replica counts only the requests sent through its handle; while its lanes carry requests
    the replica itself refuses a request through the handle once its engine holds ``lane_capacity`` (lane ones
    included); with none on its lanes (not open yet, say) Serve's limit is the bound, as with lanes off."""
    from cluster.openai_api import replica_error
    from common.errors import ReplicaFullError
    from replica.serve_replica import ServeReplica

    engine = StandInEngine()
    replica = types.SimpleNamespace(lane_capacity=2, replica_id="a", _lane_server=types.SimpleNamespace(num_active=1),
                                    engine=types.SimpleNamespace(num_requests=2, generate=engine.generate))

    async def first(request):
        return await ServeReplica.generate(replica, request).__anext__()

    with pytest.raises(ReplicaFullError):
        asyncio.run(first(EngineRequest("r1", [5])))
    assert replica_error(ReplicaFullError("full")).status == 429
    replica._lane_server.num_active = 0  # nothing on the lanes: the handle's own limit bounds it
    assert asyncio.run(first(EngineRequest("r1", [5]))).new_text == "t0"
    replica._lane_server.num_active = 1
    replica.engine.num_requests = 1
    assert asyncio.run(first(EngineRequest("r2", [5]))).new_text == "t0"
    replica.lane_capacity = 0  # lanes off: Serve's own limit is the bound
    replica.engine.num_requests = 50
    assert asyncio.run(first(EngineRequest("r3", [5]))).new_text == "t0"


def test_frames_are_read_whole_however_the_bytes_arrive_and_a_large_one_is_refused_from_its_header():
    async def scenario():
        messages = [("out", index, "x" * (index * 37)) for index in range(50)]
        data = b"".join(lane_protocol.encode(message) for message in messages)
        for chunk in (1, 7, 4096, len(data)):  # byte by byte, odd pieces, many frames in one read
            reader = asyncio.StreamReader()
            incoming = lane_protocol.FrameReader(reader)

            async def read_all():
                got = []
                while len(got) < len(messages):
                    got += await incoming.next_frames()
                return got

            consumer = asyncio.ensure_future(read_all())
            for start in range(0, len(data), chunk):
                reader.feed_data(data[start:start + chunk])
                await asyncio.sleep(0)  # the reader wakes on each piece
            assert await asyncio.wait_for(consumer, 10) == messages, chunk
        reader = asyncio.StreamReader()
        reader.feed_data(struct.pack("<I", lane_protocol.MAX_FRAME_BYTES + 1))
        with pytest.raises(lane_protocol.LaneProtocolError):
            await lane_protocol.FrameReader(reader).next_frames()
        reader = asyncio.StreamReader()
        reader.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):
            await lane_protocol.FrameReader(reader).next_frames()

    asyncio.run(scenario())


def test_requests_cancelled_before_they_ran_free_their_room():
    async def scenario():
        engine = StandInEngine()
        engine.capacity = 2
        server = LaneServer(engine.generate, engine.room, "127.0.0.1")
        sent = []
        frames = types.SimpleNamespace(send=sent.append)
        tasks: dict = {}
        for number in (1, 2):
            server._take(("gen", number, EngineRequest(f"r{number}", [5])), frames, tasks)
        server._take(("gen", 3, EngineRequest("r3", [5])), frames, tasks)
        assert sent == [("busy", 3)]  # two admitted in this read, not yet in the engine: no room for a third
        for task in list(tasks.values()):  # the lane closed before they ever ran
            task.cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not server._not_started and not tasks and engine.requests == []
        server._take(("gen", 4, EngineRequest("r4", [5])), frames, tasks)
        await until(lambda: not tasks)
        assert [message[0] for message in sent[1:]] == ["out", "out", "out"]

    asyncio.run(scenario())


class TwoArgumentError(Exception):
    """Pickles, but does not unpickle (pickle calls ``__init__`` with ``args``: one argument)."""

    def __init__(self, first, second) -> None:
        super().__init__(f"{first} {second}")


def test_an_error_the_ingress_cannot_unpickle_fails_only_its_request_not_the_lane():
    async def scenario():
        engine = StandInEngine()

        async def failing(request):
            if request.request_id == "odd":
                raise TwoArgumentError("bad", "state")
            async for output in engine.generate(request):
                yield output

        server = LaneServer(failing, engine.room, "127.0.0.1")
        location = await server.start()
        server.expect("lane-1")
        lane = await connect_lane("replica-a", location, "lane-1", asyncio.ensure_future(asyncio.sleep(9)))
        odd = lane.generate(EngineRequest("odd", [5]), lambda _: None, lambda: None)
        with pytest.raises(RuntimeError, match="could not be read"):
            await odd.__anext__()
        assert [o.new_text for o in await drain(lane.generate(EngineRequest("ok", [5]), lambda _: None,
                                                              lambda: None))] == ["t0", "t1", "t2"]
        assert not lane.closed
        lane.close()

    asyncio.run(scenario())


def test_over_a_real_engine_later_outputs_come_batched_per_step_and_tokens_are_unchanged():
    """With the engine's output channels (as ``ServeReplica`` serves lanes), each request's first output comes as
    its own frame and the rest in one frame per engine step for all the lane's requests; the greedy tokens equal
    the engine's own generate."""
    from replica.async_engine import AsyncEngine
    from tests.engine_utils import TinyModel, greedy, random_prompt

    tiny = TinyModel("llama", seed=2)
    async_engine = AsyncEngine(tiny.engine())
    prompts = {f"r{i}": random_prompt(30 + 10 * i, seed=70 + i) for i in range(3)}

    async def scenario():
        server = LaneServer(async_engine.generate, lambda: 8, "127.0.0.1", channels=async_engine)
        location = await server.start()
        server.expect("lane-1")
        lane = await connect_lane("replica-a", location, "lane-1", asyncio.ensure_future(asyncio.sleep(9)))
        streams = [lane.generate(EngineRequest(rid, prompt, greedy(8)), lambda _: None, lambda: None)
                   for rid, prompt in prompts.items()]
        results = await asyncio.gather(*(drain(stream) for stream in streams))
        lane.close()
        return server, results

    try:
        server, results = asyncio.run(scenario())
    finally:
        async_engine.shutdown()
    for (rid, prompt), outputs in zip(prompts.items(), results):
        assert outputs[0].via_channel and outputs[-1].finished
        assert [t for out in outputs for t in out.new_token_ids] == tiny.generate(prompt, 8)
    assert 0 < server.num_batches < sum(len(outputs) for outputs in results)
