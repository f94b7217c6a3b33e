"""The ingress's end of the output channels (cluster/output_channels.py), without Ray: a request's stream and the
replica's channel are fakes with the interface of Serve's response generators."""

import asyncio

import pytest

from cluster.output_channels import ChanneledStream, OutputChannelLost, OutputChannels
from common.types import CachedTokens, OutputChannelRequest, RequestOutput


def out(request_id, token, finished=False, via_channel=False, replica="A"):
    return RequestOutput(request_id, [token], f"<{token}>", finished, "length" if finished else None, 4, token,
                         CachedTokens(), replica_id=replica, via_channel=via_channel)


class FakeStream:
    """A request's Serve stream: yields what is put in, raises an exception put in, ends at None."""

    def __init__(self):
        self.items = asyncio.Queue()
        self.cancelled = False

    async def __anext__(self):
        item = await self.items.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True
        self.items.put_nowait(asyncio.CancelledError("cancelled by the caller"))


class FakeReplicas:
    """``replicas.options(stream=True).output_channel.remote(request)``: one fake channel stream per call."""

    def __init__(self):
        self.channels: dict[str, FakeStream] = {}
        self.requests: list[OutputChannelRequest] = []
        self.by_reference: list[bool] = []

    def options(self, stream, _by_reference):
        assert stream is True
        self.by_reference.append(_by_reference)
        return self

    @property
    def output_channel(self):
        return self

    def remote(self, request):
        self.requests.append(request)
        channel = FakeStream()
        self.channels[request.target_replica] = channel
        channel.items.put_nowait([])  # the replica's first message: open

        class Iterable:
            def __aiter__(self):
                return channel

            def cancel(self):
                channel.cancel()

        return Iterable()


def test_a_bound_request_reads_its_outputs_from_the_channel_in_order_even_after_its_stream_ended():
    async def scenario():
        replicas = FakeReplicas()
        channels = OutputChannels(replicas)
        # an unbound request: everything on its own stream; its first output opens a channel to its replica
        plain = FakeStream()
        wrapped = channels.stream("p", plain)
        for item in (out("p", 1), out("p", 2, finished=True), None):
            plain.items.put_nowait(item)
        assert [(await wrapped.__anext__()).new_token_ids for _ in range(2)] == [[1], [2]]
        await asyncio.sleep(0)
        assert [r.target_replica for r in replicas.requests] == ["A"] and channels.is_open("A")
        assert replicas.requests[0].channel_id == channels.channel_id
        assert replicas.by_reference == [False]  # Serve's gRPC transport by default
        # two bound requests: first outputs on their streams, the rest in shared channel messages
        streams = {rid: FakeStream() for rid in ("x", "y")}
        wrapped = {rid: channels.stream(rid, stream) for rid, stream in streams.items()}
        for rid, stream in streams.items():
            stream.items.put_nowait(out(rid, 10, via_channel=True))
        firsts = {rid: await w.__anext__() for rid, w in wrapped.items()}
        channel = replicas.channels["A"]
        channel.items.put_nowait([out("x", 11), out("y", 11)])
        channel.items.put_nowait([out("x", 12, finished=True), out("gone", 5)])  # an unknown request: dropped
        streams["x"].items.put_nowait(None)  # x's stream ends at once
        x = [firsts["x"]] + [await wrapped["x"].__anext__() for _ in range(2)]
        # y's stream ends before its last output came on the channel: the wrapper waits for it
        streams["y"].items.put_nowait(None)
        y_second = await wrapped["y"].__anext__()
        later = asyncio.ensure_future(wrapped["y"].__anext__())
        await asyncio.sleep(0.01)
        assert not later.done()
        channel.items.put_nowait([out("y", 12, finished=True)])
        y = [firsts["y"], y_second, await later]
        # no second channel to A was opened meanwhile
        assert len(replicas.requests) == 1
        return x, y

    x, y = asyncio.run(scenario())
    for outputs in (x, y):
        assert [o.new_token_ids[0] for o in outputs] == [10, 11, 12]
        assert [o.finished for o in outputs] == [False, False, True]


def test_a_bound_request_raises_its_streams_error_and_cancels_through_the_wrapper():
    class ReplicaDied(RuntimeError):
        pass

    async def scenario():
        channels = OutputChannels(FakeReplicas())
        failing, cut = FakeStream(), FakeStream()
        wrapped_failing = channels.stream("f", failing)
        wrapped_cut = channels.stream("c", cut)
        failing.items.put_nowait(out("f", 1, via_channel=True))
        cut.items.put_nowait(out("c", 1, via_channel=True))
        await wrapped_failing.__anext__()
        await wrapped_cut.__anext__()
        failing.items.put_nowait(ReplicaDied("the replica died"))
        with pytest.raises(ReplicaDied):
            await wrapped_failing.__anext__()
        pending = asyncio.ensure_future(wrapped_cut.__anext__())
        await asyncio.sleep(0)
        wrapped_cut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert cut.cancelled

    asyncio.run(scenario())


def test_a_last_output_that_never_comes_fails_the_request_after_the_wait(monkeypatch):
    import cluster.output_channels as module

    monkeypatch.setattr(module, "END_WAIT_S", 0.05)

    async def scenario():
        stream = FakeStream()
        wrapped = ChanneledStream(OutputChannels(FakeReplicas()), "r", stream, asyncio.Queue())
        stream.items.put_nowait(out("r", 1, via_channel=True))
        await wrapped.__anext__()
        stream.items.put_nowait(None)
        with pytest.raises(OutputChannelLost):
            await wrapped.__anext__()

    asyncio.run(scenario())


def test_one_request_at_a_time_opens_no_channel():
    """A first output that comes while fewer than MIN_CONCURRENT requests are in flight opens no channel (nothing to
    batch, and a single stream measured slower with one open); with more in flight it does."""
    async def scenario():
        replicas = FakeReplicas()
        inflight = [1]
        channels = OutputChannels(replicas, num_inflight=lambda: inflight[0])
        for index, count in enumerate((1, 1, 2)):
            inflight[0] = count
            stream = FakeStream()
            stream.items.put_nowait(out(f"r{index}", 1, finished=True))
            await channels.stream(f"r{index}", stream).__anext__()
            await asyncio.sleep(0)
            yield [r.target_replica for r in replicas.requests]

    async def collect():
        return [opened async for opened in scenario()]

    assert asyncio.run(collect()) == [[], [], ["A"]]


async def open_one_channel_then_close(channels: OutputChannels, request_id: str) -> None:
    """A request's first output on its own stream opens a channel to its replica; then every channel is closed."""
    plain = FakeStream()
    wrapped = channels.stream(request_id, plain)
    plain.items.put_nowait(out(request_id, 1))
    await wrapped.__anext__()
    await asyncio.sleep(0)
    channels.close()


def test_channels_open_over_the_transport_they_are_given():
    async def scenario(transport):
        replicas = FakeReplicas()
        await open_one_channel_then_close(OutputChannels(replicas, transport=transport), "p")
        return replicas.by_reference

    assert asyncio.run(scenario("ray")) == [True]
    assert asyncio.run(scenario("grpc")) == [False]


def test_a_channel_belongs_to_no_request_so_one_client_hanging_up_cannot_close_it():
    """Serve links the replica calls a request makes to that request (its request context) and cancels them when it
    is cancelled. The channel is opened from one request's code but serves every request bound to it: its call must
    carry no request's context (before, one client's disconnect failed the others with OutputChannelClosed)."""
    import ray.serve.context as serve_context

    seen = []

    class ContextRecordingReplicas(FakeReplicas):
        def remote(self, request):
            seen.append(serve_context._get_serve_request_context()._internal_request_id)
            return super().remote(request)

    async def scenario():
        replicas = ContextRecordingReplicas()
        channels = OutputChannels(replicas)
        parent = serve_context._RequestContext(route="/v1/completions", request_id="client-a",
                                               _internal_request_id="internal-a")
        serve_context._serve_request_context.set(parent)  # as inside request a's handler
        assert serve_context._get_serve_request_context()._internal_request_id == "internal-a"
        await open_one_channel_then_close(channels, "a")

    asyncio.run(scenario())
    assert len(seen) == 1 and seen[0] != "internal-a"
