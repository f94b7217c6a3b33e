"""The fixed cost of a request and the cost of each streamed token, over real HTTP, against any OpenAI server.

    # against a running server (prefixserve, vLLM, ...):
    .venv/bin/python benchmarks/serving_overhead.py --base-url http://127.0.0.1:8000 --model NAME

Three measurements, one request at a time unless said (so they show per-request and per-token overhead, not batching):

- short: 12 prompt tokens, 1 output token, non-streaming /v1/completions: wall time per request (the fixed cost);
- stream: 64-token prompt, 64 output tokens streamed (ignore_eos): TTFT and the time per further token (TPOT) at batch 1;
- concurrent: ``--concurrency`` such streams at once: their median TPOT (per-token cost with the engine batching).

Prints one JSON object (medians in milliseconds); ``--json PATH`` also writes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx


async def short_request(client: httpx.AsyncClient, model: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    response = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                            "temperature": 0})
    response.raise_for_status()
    return (time.perf_counter() - started) * 1000


async def stream_request(client: httpx.AsyncClient, model: str, prompt: list[int], num_tokens: int) -> tuple[float, float]:
    """(TTFT ms, mean ms per further token) of one streamed request."""
    body = {"model": model, "prompt": prompt, "max_tokens": num_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    started = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return (first - started) * 1000, (end - first) * 1000 / max(1, num_tokens - 1)


def prompt_of(length: int, seed: int, vocab: int) -> list[int]:
    return [(seed * 7919 + index * 104729) % (vocab - 200) + 100 for index in range(length)]


async def measure(args) -> dict:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=300) as client:
        for index in range(3):  # warm-up: compile paths, caches, connections
            await short_request(client, args.model, prompt_of(12, 1000 + index, args.vocab))
            await stream_request(client, args.model, prompt_of(64, 2000 + index, args.vocab), 8)
        shorts = [await short_request(client, args.model, prompt_of(12, index, args.vocab))
                  for index in range(args.repeats)]
        streams = [await stream_request(client, args.model, prompt_of(64, 100 + index, args.vocab), args.output_len)
                   for index in range(max(3, args.repeats // 4))]
        concurrent = []
        for round_index in range(3):
            results = await asyncio.gather(*[
                stream_request(client, args.model, prompt_of(64, 500 + 10 * round_index + i, args.vocab),
                               args.output_len) for i in range(args.concurrency)])
            concurrent.extend(tpot for _, tpot in results)
    return {
        "short_request_ms": round(statistics.median(shorts), 2),
        "stream_ttft_ms": round(statistics.median(t for t, _ in streams), 2),
        "stream_tpot_ms": round(statistics.median(p for _, p in streams), 2),
        f"concurrent{args.concurrency}_tpot_ms": round(statistics.median(concurrent), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--vocab", type=int, default=8192, help="prompt token ids are drawn below this")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
