"""Seeded mixed traffic over three engines that share a Redis host tier, a disk tier and peer copy, against
transformers' greedy generate: random prompts on five shared prefixes (cut anywhere, exact repeats, new suffixes),
random output lengths, random peer hints, bursts of concurrent requests, small pools (eviction, preemption, chunked
prefill beside decodes), and clients that stop reading after a few tokens. Every finished request must have the
reference tokens, every engine must pass its integrity check after each burst, and no page may be left in use.

The single-feature tests (test_engine_equivalence, test_kv_sources, test_fetch_sharing) check each path alone; this
one checks them interleaved, where the request order and the thread timing differ from run to run."""

import asyncio
import copy
import random
import time

import pytest

from engine_utils import TinyModel, random_prompt
from replica.async_engine import AsyncEngine
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.kv_sources import PrefixFetcher, build_tiers, page_format_of
from common.types import EngineRequest, SamplingParams
from replica.tiers.seal import TierKey

NUM_BURSTS = 14
MAX_MODEL_LEN = 1024


class Peers:
    """Peer copy between the engines of this process (the Serve transports are tested end to end elsewhere)."""

    def __init__(self) -> None:
        self.engines: dict[str, AsyncEngine] = {}

    async def fetch(self, peer_id, keys):
        return await self.engines[peer_id].export_pages(list(keys))


# (pages, max running requests, token budget of a step, Redis, disk, write policy): one engine too small for two
# long prompts at once (preemption), one with chunked prefill, one roomy
ENGINES = {
    "A": (8, 4, 128, True, True, "all"),
    "B": (12, 8, 256, False, True, "reused"),
    "C": (24, 4, 512, True, False, "all"),
}


@pytest.mark.parametrize("arch, seed", [("llama", 11), ("mistral", 12)])
def test_interleaved_sources_eviction_and_cancellation_keep_greedy_tokens(arch, seed, redis_server, tmp_path):
    rng = random.Random(seed)
    tiny = TinyModel(arch, seed=seed)
    tier_key = TierKey.generate()
    peers = Peers()
    for replica_id, (num_pages, max_seqs, budget, use_redis, use_disk, write_policy) in ENGINES.items():
        engine = LLMEngine(EngineConfig(num_pages=num_pages, replica_id=replica_id, max_num_seqs=max_seqs,
                                        max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN),
                           copy.deepcopy(tiny.served))
        page_format = page_format_of(engine)
        tiers = build_tiers(page_format, redis_url=redis_server[:-1] + str(seed % 16) if use_redis else None,
                            disk_cache_dir=str(tmp_path / "disk") if use_disk else None, disk_budget_bytes=1 << 30,
                            tier_key=tier_key, redis_timeout_s=10.0)
        fetcher = PrefixFetcher(page_format, tiers=tiers, peer_client=peers, own_replica_id=replica_id,
                                write_policy=write_policy)
        peers.engines[replica_id] = AsyncEngine(engine, fetcher)

    prefixes = [random_prompt(rng.randint(1, 520), seed=seed * 1000 + i) for i in range(5)]
    results: list[tuple[list[int], int, list[int], dict]] = []
    num_cancelled = 0

    async def one(number: int) -> None:
        nonlocal num_cancelled
        prefix = rng.choice(prefixes)
        if rng.random() < 0.15:
            prompt = list(prefix)  # an exact repeat
        else:
            cut = len(prefix) if rng.random() < 0.6 else rng.randint(0, len(prefix))
            suffix = random_prompt(rng.randint(1, 200), seed=seed * 100000 + number)
            prompt = (prefix[:cut] + suffix)[:MAX_MODEL_LEN - 16]
        num_out = rng.randint(1, 10)
        replica_id = rng.choice(sorted(ENGINES))
        hint = rng.choice([None, None] + [other for other in sorted(ENGINES) if other != replica_id])
        stop_after = rng.randint(0, 3) if rng.random() < 0.15 else None  # the client goes away
        await asyncio.sleep(rng.random() * 0.05)
        request = EngineRequest(f"r{number}", prompt, SamplingParams(max_tokens=num_out, temperature=0.0,
                                                                     ignore_eos=True), peer_hint=hint)
        tokens, last = [], None
        async for out in peers.engines[replica_id].generate(request):
            tokens.extend(out.new_token_ids)
            last = out
            if stop_after is not None and len(tokens) >= stop_after:
                break
        if stop_after is not None:
            num_cancelled += 1
            return
        results.append((prompt, num_out, tokens, last.cached_tokens.as_dict()))

    async def scenario() -> None:
        for burst in range(NUM_BURSTS):
            await asyncio.gather(*(one(burst * 100 + i) for i in range(rng.randint(1, 8))))
            for async_engine in peers.engines.values():
                async_engine.engine.check_integrity()

    try:
        asyncio.run(scenario())
        for prompt, num_out, tokens, cached in results:
            assert tokens == tiny.generate(prompt, num_out), (len(prompt), num_out, cached)
        reused = {source: sum(cached[source] > 0 for _, _, _, cached in results)
                  for source in ("local", "peer", "host", "disk")}
        assert reused["local"] > 0 and reused["host"] + reused["disk"] > 0, reused  # the paths were exercised
        assert num_cancelled > 0
        # requests a client left are aborted: nothing stays in use once the engines are idle
        deadline = time.monotonic() + 30
        while any(e.stats().num_pages_in_use for e in peers.engines.values()):
            assert time.monotonic() < deadline, {r: e.stats() for r, e in peers.engines.items()}
            time.sleep(0.05)
    finally:
        for async_engine in peers.engines.values():
            async_engine.shutdown()
