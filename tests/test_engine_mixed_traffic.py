"""Seeded mixed traffic over three engines that share a Redis host tier, a disk tier and peer copy, against
transformers' greedy generate: random prompts on five shared prefixes (cut anywhere, exact repeats, new suffixes),
random output lengths, random peer hints, retention priorities and TTLs, cache salts, bursts of concurrent requests,
small pools (eviction, preemption, chunked prefill beside decodes), clients that stop reading after a few tokens, and
now and then a prefix-cache reset or a damaged disk-tier file. Every finished request must have the reference tokens,
a request with a salt no earlier request used must reuse nothing from anywhere, every engine must pass its integrity
check after each burst, and no page may be left in use. A last request copies a fresh prefix from a peer (peer
copy in the bursts depends on timing, so it is checked once where it does not).

The single-feature tests (test_engine_equivalence, test_kv_sources, test_fetch_sharing) check each path alone; this
one checks them interleaved, where the request order and the thread timing differ from run to run."""

import asyncio
import glob
import os
import random
import time

import pytest

from engine_utils import TinyModel, random_prompt
from common.types import EngineRequest, Retention, SamplingParams
from test_kv_sources import LocalPeerClient, make_async_engine

NUM_BURSTS = 14
MAX_MODEL_LEN = 1024


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
    peers = LocalPeerClient({})
    redis_url = f"{redis_server.rsplit('/', 1)[0]}/{seed % 16}"  # a database of its own on the session's server
    for replica_id, (num_pages, max_seqs, budget, use_redis, use_disk, write_policy) in ENGINES.items():
        peers.peers[replica_id] = make_async_engine(
            tiny, replica_id, redis_url=redis_url if use_redis else None,
            disk_dir=str(tmp_path / "disk") if use_disk else None, peer_client=peers, write_policy=write_policy,
            num_pages=num_pages, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN)

    prefixes = [random_prompt(rng.randint(1, 520), seed=seed * 1000 + i) for i in range(5)]
    results: list[tuple[list[int], int, list[int], dict]] = []
    num_cancelled = num_fresh_salts = num_faults = 0

    async def one(number: int) -> None:
        nonlocal num_cancelled, num_fresh_salts
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
        draw = rng.random()
        salt = f"fresh-{number}" if draw < 0.1 else "tenant-1" if draw < 0.25 else None
        retention = Retention(priority=rng.choice([10, 50, 100]), ttl_s=rng.choice([0.5, 60.0]),
                              num_tokens=min(len(prompt), 256)) if rng.random() < 0.2 else None
        await asyncio.sleep(rng.random() * 0.05)
        request = EngineRequest(f"r{number}", prompt, SamplingParams(max_tokens=num_out, temperature=0.0,
                                                                     ignore_eos=True), peer_hint=hint,
                                cache_salt=salt, retention=retention)
        tokens, last = [], None
        async for out in peers.peers[replica_id].generate(request):
            tokens.extend(out.new_token_ids)
            last = out
            if stop_after is not None and len(tokens) >= stop_after:
                break
        if stop_after is not None:
            num_cancelled += 1
            return
        cached = last.cached_tokens.as_dict()
        if salt is not None and salt.startswith("fresh-"):
            num_fresh_salts += 1
            assert sum(cached.values()) == 0, (salt, cached)  # nobody else's pages, from any source
        results.append((prompt, num_out, tokens, cached))

    fault_rng = random.Random(seed + 1)  # its own draws: the files on disk differ from run to run, the requests do not

    async def fault() -> None:
        nonlocal num_faults
        num_faults += 1
        if fault_rng.random() < 0.5:
            await peers.peers[fault_rng.choice(sorted(ENGINES))].reset_prefix_cache()
            return
        files = sorted(glob.glob(str(tmp_path / "disk" / "**" / "*.arrow"), recursive=True))
        if files:  # bytes flipped on disk: the tier must discard the file and the page be recomputed
            try:
                with open(fault_rng.choice(files), "r+b") as damaged:
                    damaged.seek(fault_rng.randrange(max(1, os.fstat(damaged.fileno()).st_size)))
                    damaged.write(bytes(fault_rng.randrange(256) for _ in range(16)))
            except FileNotFoundError:
                pass  # a reader discarded it (damaged in an earlier burst) meanwhile

    async def scenario() -> None:
        for burst in range(NUM_BURSTS):
            jobs = [one(burst * 100 + i) for i in range(rng.randint(1, 8))]
            if rng.random() < 0.25:
                jobs.append(fault())
            await asyncio.gather(*jobs)
            for async_engine in peers.peers.values():
                async_engine.engine.check_integrity()

    async def peer_copy() -> tuple[list[int], dict]:
        """A prefix none of the traffic used, computed on A, then asked of B with A as the peer hint: B holds none of
        it, and the peer comes before the shared tiers in B's fetch order, so B must copy it from A."""
        prefix = random_prompt(3 * 128 + 5, seed=seed * 1000 + 99)
        async for _ in peers.peers["A"].generate(EngineRequest("peer-a", prefix, SamplingParams(
                max_tokens=1, temperature=0.0, ignore_eos=True))):
            pass
        prompt = prefix + random_prompt(20, seed=seed * 1000 + 98)
        tokens, last = [], None
        async for out in peers.peers["B"].generate(EngineRequest("peer-b", prompt, SamplingParams(
                max_tokens=4, temperature=0.0, ignore_eos=True), peer_hint="A")):
            tokens.extend(out.new_token_ids)
            last = out
        results.append((prompt, 4, tokens, last.cached_tokens.as_dict()))
        return tokens, last.cached_tokens.as_dict()

    try:
        asyncio.run(scenario())
        _, copied = asyncio.run(peer_copy())
        assert copied["peer"] == 3 * 128, copied
        for prompt, num_out, tokens, cached in results:
            assert tokens == tiny.generate(prompt, num_out), (len(prompt), num_out, cached)
        reused = {source: sum(cached[source] > 0 for _, _, _, cached in results)
                  for source in ("local", "peer", "host", "disk")}
        assert reused["local"] > 0 and reused["host"] + reused["disk"] > 0, reused  # the paths were exercised
        assert num_cancelled > 0 and num_fresh_salts > 0 and num_faults > 0
        # requests a client left are aborted: nothing stays in use once the engines are idle
        deadline = time.monotonic() + 30
        while any(e.stats().num_pages_in_use for e in peers.peers.values()):
            assert time.monotonic() < deadline, {r: e.stats() for r, e in peers.peers.items()}
            time.sleep(0.05)
    finally:
        for async_engine in peers.peers.values():
            async_engine.shutdown()
