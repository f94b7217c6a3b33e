#!/usr/bin/env bash
# our bf16 server: short_request_split idle, then after vLLM's prefix_repetition workload, then again
cd /work/main
RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled .venv/bin/python -m cluster serve --model benchmarks/.scratch/tiny-llama-512x8 --served-model-name tiny-llama --dtype bfloat16 --kv-cache-page-size 128 --max-model-len 4096 --max-num-batched-tokens 2048 --max-num-seqs 64 --data-parallel-degree 1 --devices cpu --kv-cache-memory 2GiB --no-enable-disk-cache --host 127.0.0.1 --port 8200 > /tmp/ps_server.log 2>&1 &
PID=$!
for i in $(seq 90); do curl -sf http://127.0.0.1:8200/health >/dev/null && break; sleep 2; done
split() { .venv/bin/python benchmarks/short_request_split.py --base-url http://127.0.0.1:8200 --model tiny-llama --requests 60; }
echo "idle: $(split)"
echo "idle: $(split)"
env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_TARGET_DEVICE=cpu /work/vllm-venv/bin/python benchmarks/vllm_wrapper.py bench serve --backend openai --base-url http://127.0.0.1:8200 --model tiny-llama --tokenizer benchmarks/.scratch/tiny-llama-512x8 --dataset-name prefix_repetition --prefix-repetition-prefix-len 1536 --prefix-repetition-suffix-len 256 --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 64 --num-prompts 48 --max-concurrency 4 --ignore-eos --seed 0 > /dev/null 2>&1
echo "after workload: $(split)"
echo "after workload: $(split)"
sleep 10
echo "after 10 s: $(split)"
kill $PID; wait $PID 2>/dev/null
