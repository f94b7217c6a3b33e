"""Where a short request's time goes: sequential 12-token, 1-output completions against a running prefixserve, the
client's wall time beside what the server's /metrics say for the same requests (engine-side queue and prefill times,
and the ingress's time to first token, measured from the parsed request).

    .venv/bin/python benchmarks/short_request_split.py --base-url http://127.0.0.1:8200 --model tiny-llama [--requests 60]

Prints one JSON object of means in ms: ``client_wall``; ``ingress_ttft`` (parsed request -> first token at the ingress);
``engine_queue`` and ``engine_prefill`` (the replica's engine thread: queued -> scheduled -> first token). So
``client_wall - ingress_ttft`` is HTTP, parsing and the response; ``ingress_ttft - engine_queue - engine_prefill`` the
tokenizer thread, routing and the replica hop both ways. Needs a server without an API key on /metrics.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import httpx

METRICS = {
    "ingress_ttft": "prefixserve_time_to_first_token_seconds",
    "engine_queue": "vllm:request_queue_time_seconds",
    "engine_prefill": "vllm:request_prefill_time_seconds",
}
METRICS_CACHE_S = 1.2
"""The ingress caches /metrics for 1 s."""


def totals(client: httpx.Client) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram in ``METRICS``, summed over label sets."""
    text = client.get("/metrics").text
    result = {}
    for key, name in METRICS.items():
        sums = re.findall(rf"^{re.escape(name)}_sum(?:{{[^}}\n]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
        counts = re.findall(rf"^{re.escape(name)}_count(?:{{[^}}\n]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
        result[key] = (sum(map(float, sums)), sum(map(float, counts)))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()

    def prompt(index: int) -> list[int]:
        return [(index * 7919 + k * 104729) % (args.vocab - 200) + 100 for k in range(12)]

    with httpx.Client(base_url=args.base_url, timeout=60) as client:
        def complete(index: int) -> float:
            started = time.perf_counter()
            response = client.post("/v1/completions", json={"model": args.model, "prompt": prompt(index),
                                                             "max_tokens": 1, "temperature": 0})
            response.raise_for_status()
            return time.perf_counter() - started

        for index in range(5):  # warm-up
            complete(10_000 + index)
        time.sleep(METRICS_CACHE_S)
        before = totals(client)
        walls = [complete(index) for index in range(args.requests)]
        time.sleep(METRICS_CACHE_S)
        after = totals(client)
    result = {"requests": args.requests, "client_wall": round(1000 * statistics.mean(walls), 2),
              "client_wall_median": round(1000 * statistics.median(walls), 2)}
    for key in METRICS:
        spent, count = (after[key][0] - before[key][0], after[key][1] - before[key][1])
        result[key] = round(1000 * spent / count, 2) if count else None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
