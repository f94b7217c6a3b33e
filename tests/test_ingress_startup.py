"""The ingress's start-up, without Ray (a fake replicas handle): it asks the replicas' info and loads the tokenizer in
the background from construction, so the first request does not pay for it; a failed ask is retried; /health says
503 "starting" until a replica has answered, then 200."""

import asyncio
from types import SimpleNamespace

from cluster.config import ServeConfig
from cluster.openai_api import OpenAIIngress


class FakeInfo:
    """``replicas.info.remote()``: the first call fails (no replica yet), later ones wait for ``answer``."""

    def __init__(self):
        self.answer = asyncio.get_running_loop().create_future()
        self.calls = 0

    def remote(self):
        self.calls += 1
        if self.calls == 1:
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(RuntimeError("no replica yet"))
            return failed
        return self.answer


def test_the_ingress_learns_its_replicas_before_any_request_and_health_says_starting_until_then(monkeypatch):
    # Serve's @serve.ingress gives the class's methods a copy of the module's globals: patch those
    module_globals = OpenAIIngress._replica_info.__globals__
    monkeypatch.setitem(module_globals, "load_tokenizer", lambda files: ("tokenizer", files))
    monkeypatch.setitem(module_globals, "HEALTH_WAIT_S", 0.05)
    monkeypatch.setitem(module_globals, "WARM_UP_RETRY_S", 0.01)

    async def scenario():
        replicas = SimpleNamespace(info=FakeInfo())
        ingress = OpenAIIngress.__new__(OpenAIIngress)
        await ingress.__init__(replicas, ServeConfig(devices="cpu"))
        starting = await ingress.health()  # the first ask failed, the second waits for a replica
        asked = replicas.info.calls
        replicas.info.answer.set_result(SimpleNamespace(tokenizer_files={"tokenizer.json": b"{}"}))
        ready = await ingress.health()
        return starting, asked, ready, ingress

    starting, asked, ready, ingress = asyncio.run(scenario())
    assert starting.status_code == 503 and b"starting" in starting.body
    assert asked == 2  # asked at construction and again after the failure, with no request made
    assert ready.status_code == 200
    assert ingress.tokenizer == ("tokenizer", {"tokenizer.json": b"{}"})
    assert ingress._info is not None
