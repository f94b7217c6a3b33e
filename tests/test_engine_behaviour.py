"""Engine behaviour beyond greedy equality: one copy of a shared prefix, sampling options, stop conditions, the async
streaming interface, counters and configuration errors."""

import asyncio
import os

import pytest
import torch

from engine_utils import TinyModel, greedy, random_prompt, run_to_completion
from replica.async_engine import AsyncEngine
from replica.config import EngineConfig
from replica.engine import InvalidRequestError, LLMEngine, build_engine
from common.types import EngineRequest
from common.types import SamplingParams
from bench.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny():
    return TinyModel("llama", seed=2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", vocab_size=1024, seed=3)


def test_concurrent_requests_share_one_copy_of_the_prefix(tiny):
    # N requests share a 3-page prefix and each needs one page of its own: P + N pages at the peak, not N x P
    engine = tiny.engine(num_pages=32)
    prefix = random_prompt(384, seed=20)
    prompts = {f"u{i}": prefix + random_prompt(50, seed=21 + i) for i in range(5)}
    for request_id, prompt in prompts.items():
        engine.add_request(EngineRequest(request_id, prompt, greedy(4)))
    peak = 0
    tokens = {request_id: [] for request_id in prompts}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        peak = max(peak, engine.stats().num_pages_in_use)
        engine.check_integrity()
    assert peak == 3 + 5
    for request_id, prompt in prompts.items():
        assert tokens[request_id] == tiny.generate(prompt, 4)
    stats = engine.stats()
    assert stats.num_prompt_tokens_queried == 5 * 434
    assert stats.num_prompt_tokens_hit == 4 * 384


def test_counters_after_hits(tiny):
    engine = tiny.engine(num_pages=16)
    prompt = random_prompt(300, seed=30)
    run_to_completion(engine, {"a": prompt}, 3)
    run_to_completion(engine, {"b": prompt}, 3)
    stats = engine.stats()
    assert (stats.num_prompt_tokens_queried, stats.num_prompt_tokens_hit) == (600, 256)
    assert (stats.num_pages_total, stats.num_pages_free, stats.num_pages_in_use) == (16, 16, 0)
    assert stats.num_pages_cached == 2
    assert stats.num_requests_finished == 2


def test_salt_isolates_caches(tiny):
    engine = tiny.engine()
    prompt = random_prompt(300, seed=31)
    engine.add_request(EngineRequest("a", prompt, greedy(2), cache_salt="tenant-a"))
    engine.add_request(EngineRequest("b", prompt, greedy(2), cache_salt="tenant-b"))
    cached = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                cached[out.request_id] = out.cached_tokens.total
    assert cached == {"a": 0, "b": 0}
    tokens, finals = run_to_completion(engine, {"c": prompt}, 2)
    assert finals["c"].cached_tokens.total == 0  # unsalted differs from both
    engine.add_request(EngineRequest("d", prompt, greedy(2), cache_salt="tenant-a"))
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                cached[out.request_id] = out.cached_tokens.local
    assert cached["d"] == 256


def test_seeded_sampling_is_reproducible_and_options_apply(tiny):
    engine = tiny.engine()
    prompt = random_prompt(20, seed=32)

    def sample(request_id, params):
        engine.add_request(EngineRequest(request_id, prompt, params))
        tokens = []
        while engine.has_work():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
        return tokens

    params = SamplingParams(max_tokens=12, temperature=1.5, seed=7, ignore_eos=True)
    first, second = sample("s1", params), sample("s2", params)
    assert first == second and len(first) == 12
    other = sample("s3", SamplingParams(max_tokens=12, temperature=1.5, seed=8, ignore_eos=True))
    assert other != first
    # top_k=1 is greedy whatever the temperature
    top1 = sample("s4", SamplingParams(max_tokens=8, temperature=2.0, top_k=1, seed=1, ignore_eos=True))
    assert top1 == tiny.generate(prompt, 8)
    # a tiny top_p keeps only the most likely token: greedy too
    top_p = sample("s5", SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, seed=1, ignore_eos=True))
    assert top_p == tiny.generate(prompt, 8)


def test_stop_token_ids_and_max_tokens(tiny):
    engine = tiny.engine()
    prompt = random_prompt(40, seed=33)
    reference = tiny.generate(prompt, 8)
    stop_at = reference[3]
    first_index = reference.index(stop_at)
    engine.add_request(EngineRequest("x", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                                 stop_token_ids=(stop_at,))))
    tokens, reason = [], None
    while engine.has_work():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            reason = out.finish_reason
    assert tokens == reference[: first_index + 1] and reason == "stop"


def test_eos_stops_unless_ignored(tiny):
    prompt = random_prompt(40, seed=34)
    reference = tiny.generate(prompt, 8)
    eos = reference[2]
    engine = LLMEngine(EngineConfig(num_pages=16), tiny.served, eos_token_ids={eos})
    engine.add_request(EngineRequest("e", prompt, SamplingParams(max_tokens=8, temperature=0.0)))
    engine.add_request(EngineRequest("i", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    tokens = {"e": [], "i": []}
    reasons = {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert tokens["e"] == reference[: reference.index(eos) + 1] and reasons["e"] == "stop"
    assert tokens["i"] == reference and reasons["i"] == "length"


def test_stop_strings_cut_text(tiny_dir):
    engine = build_engine(EngineConfig(model=str(tiny_dir), num_pages=16))
    prompt = engine.tokenizer.encode("def main():\n    return")
    free = []
    engine.add_request(EngineRequest("free", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)))
    while engine.has_work():
        free.extend(engine.step())
    full_text = "".join(out.new_text for out in free)
    assert full_text == engine.tokenizer.decode([t for o in free for t in o.new_token_ids], skip_special_tokens=True)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 2]
    assert stop
    engine.add_request(EngineRequest("cut", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                                   stop=(stop,))))
    outs = []
    while engine.has_work():
        outs.extend(engine.step())
    text = "".join(out.new_text for out in outs)
    assert text == full_text[: full_text.index(stop)]
    assert outs[-1].finish_reason == "stop"
    engine.check_integrity()


def test_validation_errors(tiny):
    engine = tiny.engine(max_model_len=512)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(EngineRequest("a", [], greedy(1)))
    with pytest.raises(InvalidRequestError, match="at most 512"):
        engine.add_request(EngineRequest("b", [5] * 512, greedy(1)))
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request(EngineRequest("c", [5, 10**6], greedy(1)))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert not engine.has_work()


def test_output_stops_at_max_model_len(tiny):
    engine = tiny.engine(max_model_len=260)
    tokens, finals = run_to_completion(engine, {"a": random_prompt(255, seed=35)}, 50)
    assert len(tokens["a"]) == 5 and finals["a"].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"page_size": 100}, "multiple of 128"),
        ({"page_size": 0}, "multiple of 128"),
        ({"devices": "tpu"}, "one of cpu, gpu"),
        ({"dtype": "float16"}, "auto, float32, bfloat16"),
        ({"max_model_len": 1}, "--max-model-len"),
    ],
)
def test_config_errors_name_the_remedy(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_multimodal_switches_caching_off(tiny, caplog):
    engine = LLMEngine(EngineConfig(num_pages=16), tiny.served, multimodal=True)
    assert "prefix caching is switched off" in caplog.text
    prompt = random_prompt(300, seed=36)
    run_to_completion(engine, {"a": prompt}, 2)
    _, finals = run_to_completion(engine, {"b": prompt}, 2)
    assert finals["b"].cached_tokens.total == 0


def test_async_engine_streams_and_aborts(tiny):
    engine = tiny.engine()
    async_engine = AsyncEngine(engine)
    prompt = random_prompt(200, seed=37)

    async def collect(request_id, max_tokens):
        outs = []
        async for out in async_engine.generate(EngineRequest(request_id, prompt, greedy(max_tokens))):
            outs.append(out)
        return outs

    async def abort_early():
        gen = async_engine.generate(EngineRequest("abort-me", prompt, greedy(50)))
        first = await gen.__anext__()
        await gen.aclose()
        return first

    async def main():
        results = await asyncio.gather(collect("a", 5), collect("b", 7), abort_early())
        with pytest.raises(InvalidRequestError):
            await collect_invalid()
        await async_engine.check_integrity()
        return results

    async def collect_invalid():
        async for _ in async_engine.generate(EngineRequest("bad", [], greedy(1))):
            pass

    try:
        a, b, first = asyncio.run(main())
    finally:
        async_engine.shutdown()
    # one output per step unless the consumer lagged (then queued outputs are merged): 5 tokens either way
    assert sum(len(o.new_token_ids) for o in a) == 5 and all(o.new_token_ids for o in a)
    assert a[-1].finished and a[-1].finish_reason == "length"
    assert [t for o in b for t in o.new_token_ids] == tiny.generate(prompt, 7)
    assert not first.finished
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_pages_in_use == 0
    events = async_engine.drain_kv_events()
    assert events and events[0].keys[0] == engine.page_keys(prompt)[0]


def test_outputs_queued_for_a_slow_consumer_are_merged():
    from replica.async_engine import coalesce_pending
    from common.types import CachedTokens, RequestOutput

    def out(tokens, text, finished=False, n=0):
        return RequestOutput("r", tokens, text, finished, "length" if finished else None, 10, n, CachedTokens(local=5))

    async def scenario():
        queue = asyncio.Queue()
        for item in (out([2], "b", n=2), out([3], "c", finished=True, n=3)):
            queue.put_nowait(item)
        merged = coalesce_pending(out([1], "a", n=1), queue)
        queue.put_nowait(RuntimeError("engine died"))
        untouched = coalesce_pending(out([4], "d", n=4), queue)
        return merged, untouched, queue.qsize()

    merged, untouched, left = asyncio.run(scenario())
    assert (merged.new_token_ids, merged.new_text, merged.finished, merged.num_output_tokens) == ([1, 2, 3], "abc",
                                                                                                  True, 3)
    assert untouched.new_token_ids == [4] and left == 1


def watch_forwards(engine: LLMEngine, probe) -> list:
    """Wrap ``engine.runner.run`` so that every forward first appends ``probe(inputs)`` to the list returned (what a
    step looked like from inside it: its size, torch's thread count, the step helper's state)."""
    seen = []
    run = engine.runner.run

    def watched_run(inputs):
        seen.append(probe(inputs))
        return run(inputs)

    engine.runner.run = watched_run
    return seen


def test_long_steps_run_on_the_prefill_thread_count_and_decode_steps_on_the_replica_s(tiny, monkeypatch):
    """CPU: a step of PREFILL_THREADS_MIN_TOKENS or more runs on ``num_prefill_threads``, a shorter one on
    ``num_threads`` (switched on the stepping thread, only when it changes), unless its rows attend
    PREFILL_THREADS_MIN_KEYS keys or more (here lowered to 46: a 44-token prompt's second decode step attends 46);
    greedy output is unchanged, and no step compiles the graph again (one graph serves both counts: the runner
    compiled it on ``compile_thread_count`` threads and ran a warm-up step on each count when it was built)."""
    import replica.engine as engine_module
    from replica.config import PREFILL_THREADS_MIN_KEYS, PREFILL_THREADS_MIN_TOKENS

    assert PREFILL_THREADS_MIN_KEYS > 2 * PREFILL_THREADS_MIN_TOKENS + 40  # the first prompts stay below it

    engine = tiny.engine(num_threads=1, num_prefill_threads=2)
    if engine.runner.backend == "compiled":  # (the eager path, PREFIXSERVE_ENFORCE_EAGER=1, switches threads alike)
        assert {1, 2} <= engine.runner._compiled.warmed_up
    compiles = engine.runner.num_compiles  # compiled and warmed up at start-up: no step below compiles
    seen = watch_forwards(engine, lambda inputs: (sum(len(chunk.token_ids) for chunk in inputs),
                                                  torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        prompts = {"long": random_prompt(PREFILL_THREADS_MIN_TOKENS + 40, seed=60),
                   "short": random_prompt(PREFILL_THREADS_MIN_TOKENS - 20, seed=61)}
        for request_id, prompt in prompts.items():
            assert run_to_completion(engine, {request_id: prompt}, 4)[0][request_id] == tiny.generate(prompt, 4)
        monkeypatch.setattr(engine_module, "PREFILL_THREADS_MIN_KEYS", PREFILL_THREADS_MIN_TOKENS - 18)
        prompt = random_prompt(PREFILL_THREADS_MIN_TOKENS - 20, seed=62)
        assert run_to_completion(engine, {"keys": prompt}, 4)[0]["keys"] == tiny.generate(prompt, 4)
    finally:
        torch.set_num_threads(before)
    assert seen == [(PREFILL_THREADS_MIN_TOKENS + 40, 2), (1, 1), (1, 1), (1, 1),
                    (PREFILL_THREADS_MIN_TOKENS - 20, 1), (1, 1), (1, 1), (1, 1),
                    (PREFILL_THREADS_MIN_TOKENS - 20, 1), (1, 1), (1, 2), (1, 2)]
    assert engine.runner.num_compiles == compiles
    with pytest.raises(ValueError, match="--num-prefill-threads"):
        EngineConfig(num_prefill_threads=0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the step helper needs a second CPU")
def test_short_steps_of_a_replica_with_a_second_core_arm_the_step_helper_around_their_forward(tiny, monkeypatch):
    """CPU, decode on one thread and prefill on two, linear layers on the pair kernel: every step that runs on one
    thread arms the pair kernel's step helper, which is armed during its forward and takes chunks there, and disarmed
    after it, also when the forward raises; steps on two threads do not arm it. Greedy output is unchanged. An engine
    with one thread for every step, or with ``PREFIXSERVE_STEP_HELPER=0``, never arms it."""
    import replica.engine as engine_module
    from replica import cpu_kernels
    from replica.config import PREFILL_THREADS_MIN_TOKENS

    calls = []
    arm = cpu_kernels.arm_step_helper

    def recording_arm(on: bool) -> None:
        calls.append((on, torch.get_num_threads()))
        arm(on)

    monkeypatch.setattr(engine_module.cpu_kernels, "arm_step_helper", recording_arm)
    engine = tiny.engine(num_threads=1, num_prefill_threads=2)
    if engine.runner.pair_rows == (0, 0):
        pytest.skip("the linear layers do not run the pair kernel on this CPU")
    lone = 1 if engine.runner.backend == "compiled" else 2  # compiled: a lone float32 token is padded to 2 rows
    assert engine.runner.pair_rows == (lone, engine.runner.pair_rows[1])
    armed_in_forward = watch_forwards(engine, lambda inputs: cpu_kernels.step_helper_armed())
    before, taken = torch.get_num_threads(), cpu_kernels.step_helper_chunks()
    try:
        for request_id, length in (("long", PREFILL_THREADS_MIN_TOKENS + 40), ("short", 12)):
            prompt = random_prompt(length, seed=70 + length)
            assert run_to_completion(engine, {request_id: prompt}, 4)[0][request_id] == tiny.generate(prompt, 4)
    finally:
        torch.set_num_threads(before)
    # the long prompt: not armed; its 3 decode steps, the short prompt, its 3 decode steps: armed, then disarmed (a
    # lone token only where it reaches the pair kernel)
    armed = [False] + [lone == 1] * 3 + [True] + [lone == 1] * 3
    assert calls == [(True, 1), (False, 1)] * sum(armed)
    assert armed_in_forward == armed and not cpu_kernels.step_helper_armed()
    if lone == 1:  # (eager float32 arms one step: the tiny model's may end before the helper has woken)
        # The helper takes chunks only when it is on the other core in time: with that core busy (Ray's processes in
        # a test session) the caller may finish a tiny step's chunks first. More armed steps, until it has taken one.
        try:
            for attempt in range(30):
                if cpu_kernels.step_helper_chunks() > taken:
                    break
                prompt = random_prompt(12, seed=100 + attempt)
                request_id = f"more-{attempt}"
                assert run_to_completion(engine, {request_id: prompt}, 4)[0][request_id] == tiny.generate(prompt, 4)
        finally:
            torch.set_num_threads(before)
        assert cpu_kernels.step_helper_chunks() > taken

    def failing_run(inputs):
        raise RuntimeError("the forward failed")

    engine.runner.run = failing_run
    engine.add_request(EngineRequest(request_id="fails", prompt_token_ids=random_prompt(12, seed=90),
                                     sampling=greedy(2)))
    with pytest.raises(RuntimeError, match="the forward failed"):
        engine.step()
    torch.set_num_threads(before)
    assert [on for on, _ in calls[-2:]] == [True, False] and not cpu_kernels.step_helper_armed()
    calls.clear()
    single = tiny.engine(num_threads=1, num_prefill_threads=1)
    prompt = random_prompt(12, seed=80)
    assert run_to_completion(single, {"one": prompt}, 3)[0]["one"] == tiny.generate(prompt, 3)
    monkeypatch.setenv("PREFIXSERVE_STEP_HELPER", "0")
    switched_off = tiny.engine(num_threads=1, num_prefill_threads=2)
    try:
        assert run_to_completion(switched_off, {"off": prompt}, 3)[0]["off"] == tiny.generate(prompt, 3)
    finally:
        torch.set_num_threads(before)
    assert calls == []


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the step helper needs a second CPU")
def test_decode_batches_of_17_rows_and_more_arm_the_step_helper_below_the_prefill_thread_count(tiny):
    """A decode batch of 24 requests (above the pair kernel's 16 rows alone, below PREFILL_THREADS_MIN_TOKENS) runs on
    one thread with the helper armed (its linear layers then run the pair kernel in row groups, shared with the
    helper: test_cpu_linear.py); steps of 64+ tokens (the prompts') are not armed. Every request's greedy tokens are
    the reference's."""
    from replica import cpu_kernels
    from replica.config import PREFILL_THREADS_MIN_TOKENS

    engine = tiny.engine(num_threads=1, num_prefill_threads=2, max_num_seqs=32)
    if engine.runner.pair_rows == (0, 0):
        pytest.skip("the linear layers do not run the pair kernel on this CPU")
    assert engine.runner.pair_rows[1] == cpu_kernels.max_shared_pair_rows() + 1 > PREFILL_THREADS_MIN_TOKENS
    seen = watch_forwards(engine, lambda inputs: (sum(len(chunk.token_ids) for chunk in inputs),
                                                  cpu_kernels.step_helper_armed()))
    prompts = {f"batch{i}": random_prompt(5 + i % 4, seed=200 + i) for i in range(24)}
    before = torch.get_num_threads()
    try:
        tokens = run_to_completion(engine, prompts, 4)[0]
    finally:
        torch.set_num_threads(before)
    for request_id, prompt in prompts.items():
        assert tokens[request_id] == tiny.generate(prompt, 4), request_id
    assert all(armed == (rows < PREFILL_THREADS_MIN_TOKENS) for rows, armed in seen), seen
    assert [rows for rows, _ in seen[-2:]] == [24, 24]  # the last decode steps: all 24 requests, armed
    assert not cpu_kernels.step_helper_armed()


def test_the_graph_is_compiled_on_every_cpu_when_steps_switch_thread_counts(monkeypatch):
    """Inductor fixes a parallel loop's thread count at compile time unless compiled on every CPU (then the loop
    follows the stepping thread): so with two counts the one graph is compiled on every CPU; with one, on that one."""
    from replica.engine import compile_threads

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert compile_threads(EngineConfig(num_threads=3, num_prefill_threads=4)) == 8
    assert compile_threads(EngineConfig(num_threads=3)) == 3
    assert compile_threads(EngineConfig(num_threads=3, num_prefill_threads=3)) == 3
    assert compile_threads(EngineConfig(devices="gpu", num_threads=3, num_prefill_threads=4)) == 3


def test_requests_bound_to_an_output_channel_stream_their_outputs_as_one_message_per_step(tiny):
    """A request that names an open output channel gets its first output on its own stream (marked ``via_channel``),
    then every later output on the channel, batched per step with the other bound requests' outputs; its own stream
    then ends without another output. The tokens equal an unbound request's (greedy). A request naming no channel, or
    a closed one, keeps its own stream. Closing the channel fails the requests still bound to it."""
    from replica.async_engine import OutputChannelClosed

    engine = tiny.engine()
    async_engine = AsyncEngine(engine)
    prompts = {f"r{i}": random_prompt(40 + 10 * i, seed=50 + i) for i in range(3)}
    # outputs that queue up before the caller reads the first are merged into it (``coalesce_pending``): with 6 tokens
    # a loaded CI box once let all of them land first, and a finished first output is never bound
    steps = 32

    async def own_stream(request_id, prompt, max_tokens, channel_id=None):
        request = EngineRequest(request_id, prompt, greedy(max_tokens), output_channel=channel_id)
        return [out async for out in async_engine.generate(request)]

    async def main():
        unbound = {rid: await own_stream(rid + "-alone", prompt, steps) for rid, prompt in prompts.items()}
        channel = async_engine.open_channel("ingress-1")
        received = []

        async def read_channel():
            while (batch := await channel.next_batch(idle_s=0.5)) is not None:
                received.append(batch)

        reader = asyncio.ensure_future(read_channel())
        bound = await asyncio.gather(*[own_stream(rid, prompt, steps, "ingress-1")
                                       for rid, prompt in prompts.items()])
        elsewhere = await own_stream("other", prompts["r0"], 3, "another-ingress")  # no such channel here
        await reader  # ends once idle with nothing bound
        # a bound request whose channel closes mid-way fails on its own stream
        channel = async_engine.open_channel("ingress-1")
        gen = async_engine.generate(EngineRequest("cut", prompts["r1"], greedy(40), output_channel="ingress-1"))
        first = await gen.__anext__()
        async_engine.close_channel(channel)
        with pytest.raises(OutputChannelClosed):
            await gen.__anext__()
        await async_engine.check_integrity()
        return unbound, bound, elsewhere, received, first

    try:
        unbound, bound, elsewhere, received, first = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert first.via_channel
    on_channel = [out for batch in received for out in batch]
    for rid, own in zip(prompts, bound):
        assert len(own) == 1 and own[0].via_channel and not own[0].finished  # the first output only
        rest = [out for out in on_channel if out.request_id == rid]
        tokens = own[0].new_token_ids + [t for out in rest for t in out.new_token_ids]
        assert tokens == [t for out in unbound[rid] for t in out.new_token_ids] == tiny.generate(prompts[rid], steps)
        assert rest[-1].finished and not any(out.finished for out in rest[:-1])
        assert "".join(out.new_text for out in own + rest) == "".join(out.new_text for out in unbound[rid])
    # one message per step for all three requests, not one per request per step
    assert len(received) < len(on_channel) and max(len(batch) for batch in received) >= 2
    assert not any(out.via_channel for out in elsewhere) and elsewhere[-1].finished
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_pages_in_use == 0


def test_a_fine_tune_that_keeps_the_embeddings_and_head_has_its_own_fingerprint():
    """A merged adapter or a fine-tune with frozen embeddings and head changes only weights in between: its KV must
    never be shared with the base model's (the fingerprint is in every page key and tier header)."""
    import copy

    from replica.model_runner import compute_model_fingerprint

    base = TinyModel("llama", seed=5).served
    tuned = copy.deepcopy(base)
    with torch.no_grad():
        tuned.model.layers[0].self_attn.v_proj.weight.add_(0.5)
    same = copy.deepcopy(base)
    assert compute_model_fingerprint(base, torch.float32) == compute_model_fingerprint(same, torch.float32)
    assert compute_model_fingerprint(base, torch.float32) != compute_model_fingerprint(tuned, torch.float32)
    assert compute_model_fingerprint(base, torch.float32) != compute_model_fingerprint(base, torch.bfloat16)
    # a parameter large enough to be sampled still changes the fingerprint when a dense update changes it
    big = torch.nn.Linear(2048, 1024, bias=False)
    base.model.layers[0].mlp.register_parameter("extra", big.weight)
    before = compute_model_fingerprint(base, torch.float32)
    with torch.no_grad():
        big.weight.mul_(1.01)
    assert compute_model_fingerprint(base, torch.float32) != before


def test_page_keys_from_the_ingress_are_never_trusted(tiny):
    """A request whose page keys belong to another prompt (a stale or buggy ingress; page 0 shared, so the first key
    matches) must neither read nor cache KV under them: the engine computes its own keys."""
    engine = tiny.engine(num_pages=16)
    head = random_prompt(128, seed=1)
    p1 = head + random_prompt(2 * 128 + 5, seed=2)
    p2 = head + random_prompt(2 * 128 + 5, seed=3)
    engine.add_request(EngineRequest("x", p1, greedy(4), page_keys=engine.page_keys(p2)))
    while engine.has_work():
        engine.step()
    tokens, finals = run_to_completion(engine, {"y": p2}, 4)
    assert finals["y"].cached_tokens.total == 128  # only the shared first page
    assert tokens["y"] == tiny.generate(p2, 4)


def test_a_flood_of_one_off_prompts_does_not_evict_a_reused_prefix(tiny):
    """The segmented LRU (replica/page_pool.py): a system prompt that requests reused stays cached through a flood
    of prompts seen once that turns the pool over; with plain LRU (fraction 0) the flood evicts it."""
    system = random_prompt(3 * 128, seed=40)
    kept = {}
    for fraction in (0.7, 0.0):
        engine = tiny.engine(num_pages=12, kv_cache_protected_fraction=fraction)
        run_to_completion(engine, {"first": system + random_prompt(20, seed=41)}, 2)
        run_to_completion(engine, {"second": system + random_prompt(20, seed=42)}, 2)  # a reuse: protected
        for index in range(6):  # 6 one-off prompts of 3 full pages each: 18 pages through a 12-page pool
            run_to_completion(engine, {f"flood{index}": random_prompt(3 * 128 + 20, seed=50 + index)}, 2)
        prompt = system + random_prompt(20, seed=43)
        tokens, finals = run_to_completion(engine, {"later": prompt}, 2)
        assert tokens["later"] == tiny.generate(prompt, 2)
        kept[fraction] = finals["later"].cached_tokens.total
        engine.check_integrity()
    assert kept == {0.7: 3 * 128, 0.0: 0}


def test_seeds_use_all_64_bits(tiny):
    """torch's CPU generator keeps 32 bits of a seed: seeds 1 and 2**32 + 1 used to sample the same tokens. Seeds below
    2**32 keep their meaning (the same samples as before); larger and negative ones are hashed."""
    from replica.engine import generator_seed

    assert [generator_seed(seed) for seed in (0, 1, 2**32 - 1)] == [0, 1, 2**32 - 1]
    assert len({generator_seed(seed) for seed in (1, 2**32 + 1, -1, 2**63 - 1, -(2**63))} | {0}) == 6
    engine = tiny.engine()
    prompt = random_prompt(40, seed=60)
    sampled = {}
    for seed in (1, 2**32 + 1):
        engine.add_request(EngineRequest(f"s{seed}", prompt, SamplingParams(max_tokens=12, temperature=1.0,
                                                                             seed=seed, ignore_eos=True)))
        tokens = []
        while engine.has_work():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
        sampled[seed] = tokens
    assert sampled[1] != sampled[2**32 + 1]


def test_a_long_prompt_s_keys_are_hashed_before_the_engine_thread_and_match(tiny, monkeypatch):
    """The async engine hashes a long prompt's page keys on a worker thread and hands them to ``plan``; they are the
    engine's own keys, and the request hits the cache as before."""
    import replica.async_engine as async_engine_module

    monkeypatch.setattr(async_engine_module, "KEYS_OFF_THREAD_MIN_TOKENS", 200)
    engine = tiny.engine()
    handed = []
    plan = engine.plan

    def recording_plan(request, page_keys=None):
        handed.append(page_keys)
        return plan(request, page_keys)

    engine.plan = recording_plan
    async_engine = AsyncEngine(engine)
    prompt = random_prompt(300, seed=61)

    async def ask(request_id):
        outputs = [out async for out in async_engine.generate(EngineRequest(request_id, prompt, greedy(2)))]
        return [t for out in outputs for t in out.new_token_ids], outputs[-1].cached_tokens.total

    try:
        first, second = asyncio.run(ask("a")), asyncio.run(ask("b"))
    finally:
        async_engine.shutdown()
    assert handed == [engine.page_keys(prompt)] * 2
    assert first[0] == second[0] == tiny.generate(prompt, 2) and (first[1], second[1]) == (0, 256)
