"""Start-up and the first requests of an engine, in process: build time (model load + compile + warm-up), then two
5-token greedy requests one after the other, each timed from ``add_request`` to its last token. With
``num_threads`` 1 and ``num_prefill_threads`` 2 (a DP=1 replica on a 2-core box) the steps switch thread counts;
Dynamo guards the compiled graph on the count, so a count the warm-up did not run on compiles again inside the first
request (run with ``TORCH_LOGS=recompiles`` to see where).

    PYTHONPATH=. .venv/bin/python benchmarks/first_request.py --model DIR [--threads 1] [--prefill-threads 2]
"""

from __future__ import annotations

import argparse
import time

from common.types import EngineRequest, SamplingParams
from replica.config import EngineConfig
from replica.engine import build_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill-threads", type=int, default=2)
    args = parser.parse_args()
    started = time.perf_counter()
    engine = build_engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=1 << 28,
                                       num_threads=args.threads, num_prefill_threads=args.prefill_threads))
    print(f"build: {time.perf_counter() - started:.1f} s")
    for index, prompt in enumerate(([1, 504, 3575, 282, 4649, 314], [1, 504, 3575, 282, 5234, 314])):
        started = time.perf_counter()
        engine.add_request(EngineRequest(f"r{index}", prompt, SamplingParams(max_tokens=5, temperature=0,
                                                                             ignore_eos=True)))
        while engine.has_work():
            engine.step()
        print(f"request {index}: {time.perf_counter() - started:.3f} s")


if __name__ == "__main__":
    main()
