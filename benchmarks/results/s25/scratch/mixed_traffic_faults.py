"""Scratch fuzz 2: fuzz.py plus retention, cache salts (a fresh salt must reuse nothing), prefix-cache resets, a Redis
restart and damaged disk files mid-run; greedy tokens vs reference, integrity each burst, no leaks at the end."""
import asyncio, copy, glob, os, random, sys, tempfile, time
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
from engine_utils import TinyModel, random_prompt
from conftest import RedisProcess
from replica.async_engine import AsyncEngine
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.kv_sources import PrefixFetcher, build_tiers, page_format_of
from common.types import EngineRequest, SamplingParams, Retention
from replica.tiers.seal import TierKey
from common.errors import InvalidRequestError

arch = sys.argv[1]; seed = int(sys.argv[2]); bursts = int(sys.argv[3])
rng = random.Random(seed)
tiny = TinyModel(arch, seed=seed)
KEY = TierKey.generate()
redis = RedisProcess(); redis.start()
disk = tempfile.mkdtemp()

class Peers:
    def __init__(self): self.peers = {}
    async def fetch(self, peer_id, keys):
        return await self.peers[peer_id].export_pages(list(keys))

peers = Peers(); engines = {}
for rid in "ABC":
    num_pages = rng.choice([8, 12, 24])
    eng = LLMEngine(EngineConfig(num_pages=num_pages, replica_id=rid, max_num_seqs=rng.choice([2, 4, 8]),
                                 max_num_batched_tokens=rng.choice([128, 256, 512]), max_model_len=1024,
                                 kv_cache_retention_budget=rng.choice([0.0, 0.25, 0.5, 1.0])),
                    copy.deepcopy(tiny.served))
    fmt = page_format_of(eng)
    use_redis, use_disk = rng.random() < 0.7, rng.random() < 0.7
    tiers = build_tiers(fmt, redis_url=redis.url if use_redis else None, disk_cache_dir=disk if use_disk else None,
                        disk_budget_bytes=1 << 30, tier_key=KEY, redis_timeout_s=2.0)
    fetcher = PrefixFetcher(fmt, tiers=tiers, peer_client=peers, own_replica_id=rid,
                            write_policy=rng.choice(["all", "reused"]))
    engines[rid] = peers.peers[rid] = AsyncEngine(eng, fetcher)
    print(rid, num_pages, eng.config.max_num_seqs, eng.config.max_num_batched_tokens, use_redis, use_disk)

prefixes = [random_prompt(rng.randint(1, 520), seed=seed * 1000 + i) for i in range(5)]
stats = dict(refused=0, total=0, mismatch=0, cancelled=0, salted=0, salt_leak=0, faults=0)
sources = {}

async def one(i):
    p = rng.choice(prefixes)
    if rng.random() < 0.15:
        prompt = list(p)
    else:
        cut = len(p) if rng.random() < 0.6 else rng.randint(0, len(p))
        prompt = (p[:cut] + random_prompt(rng.randint(1, 200), seed=seed * 100000 + i))[:1000]
    n = rng.randint(1, 10)
    rid = rng.choice("ABC")
    hint = rng.choice([None, None] + [x for x in "ABC" if x != rid])
    salt = None
    fresh_salt = False
    r = rng.random()
    if r < 0.1:
        salt = f"fresh-{i}"; fresh_salt = True
    elif r < 0.25:
        salt = "tenant-1"
    retention = Retention(priority=rng.choice([10, 50, 100]), ttl_s=rng.choice([0.5, 5.0, 60.0])) \
        if rng.random() < 0.2 else None
    stop_after = rng.randint(0, 3) if rng.random() < 0.1 else None
    await asyncio.sleep(rng.random() * 0.05)
    req = EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                        peer_hint=hint, cache_salt=salt, retention=retention)
    toks, last = [], None
    try:
        async for out in engines[rid].generate(req):
            toks.extend(out.new_token_ids); last = out
            if stop_after is not None and len(toks) >= stop_after:
                break
    except InvalidRequestError:
        stats["refused"] += 1; return
    if stop_after is not None:
        stats["cancelled"] += 1; return
    stats["total"] += 1
    c = last.cached_tokens.as_dict()
    for k, v in c.items():
        if v: sources[k] = sources.get(k, 0) + 1
    if fresh_salt:
        stats["salted"] += 1
        if sum(c.values()): stats["salt_leak"] += 1; print("SALT LEAK", i, rid, c, flush=True)
    if toks != tiny.generate(prompt, n):
        stats["mismatch"] += 1
        print("MISMATCH", f"r{i}", rid, hint, len(prompt), n, c, salt, retention, flush=True)

async def fault():
    k = rng.random()
    stats["faults"] += 1
    if k < 0.3:
        await engines[rng.choice("ABC")].reset_prefix_cache(); print("fault: reset", flush=True)
    elif k < 0.55:
        redis.stop(); await asyncio.sleep(0.3); redis.start(); print("fault: redis restart", flush=True)
    elif k < 0.8:
        files = [f for f in glob.glob(os.path.join(disk, "**", "*"), recursive=True) if os.path.isfile(f)]
        if files:
            f = rng.choice(files)
            with open(f, "r+b") as fh:
                size = os.path.getsize(f); fh.seek(rng.randrange(max(size, 1))); fh.write(os.urandom(16))
            print("fault: damaged", os.path.basename(f), flush=True)
    else:
        files = [f for f in glob.glob(os.path.join(disk, "**", "*"), recursive=True) if os.path.isfile(f)]
        if files:
            files = [f for f in files if not f.endswith("-shm")]
            f = rng.choice(files); open(f, "wb").close(); print("fault: truncated", os.path.basename(f), flush=True)

async def main():
    for b in range(bursts):
        jobs = [one(b * 100 + j) for j in range(rng.randint(1, 8))]
        if rng.random() < 0.2: jobs.append(fault())
        await asyncio.gather(*jobs)
        for e in engines.values(): e.engine.check_integrity()
asyncio.run(main())
deadline = time.time() + 30
while any(e.stats().num_pages_in_use for e in engines.values()) and time.time() < deadline: time.sleep(0.1)
leak = {r: e.stats().num_pages_in_use for r, e in engines.items()}
print(f"{arch} seed {seed}: {stats} sources {sources} in_use {leak}", flush=True)
for e in engines.values(): e.shutdown()
redis.stop()
