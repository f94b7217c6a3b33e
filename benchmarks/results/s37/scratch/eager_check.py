"""The same-node peer copy into landing pages with --enforce-eager (session 37's reread): greedy tokens against
transformers, no write into the pool, one reservation. Run from the repository root:

    .venv/bin/python benchmarks/results/s37/scratch/eager_check.py
"""
import asyncio
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]
import test_kv_sources as t
from engine_utils import TinyModel, random_prompt
tiny = TinyModel("llama", seed=5)
prefix = random_prompt(t.PREFIX_PAGES * 128 + 20, seed=50)
first, second = prefix + random_prompt(30, seed=51), prefix + random_prompt(40, seed=52)
holder = t.make_async_engine(tiny, "A", write_policy="reused", enforce_eager=True)
client = t.SameNodePeerClient({"A": holder})
reader = t.make_async_engine(tiny, "B", peer_client=client, write_policy="reused", enforce_eager=True)
asyncio.run(t.ask(holder, first, "a"))
writes, reservations = t.CountingWrites(reader.engine.runner), t.reserved_pages(reader)
tokens, cached = asyncio.run(t.ask(reader, second, "b", peer_hint="A"))
print("eager: tokens equal transformers:", tokens == tiny.generate(second, t.NUM_OUT), "peer tokens", cached.peer,
      "pool writes", writes.page_ids, "reserved", reservations)
holder.shutdown(); reader.shutdown()
