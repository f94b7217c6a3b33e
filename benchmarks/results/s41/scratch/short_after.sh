#!/usr/bin/env bash
# short_after.sh DTYPE ROUNDS [MODES]: one server per round and mode (MODES, "1 0": PREFIXSERVE_STEP_HELPER=1/0;
# a mode H:N also sets XP_HELPER_NICE=N, read only by a temporary hook in step_helper.h for session 41's experiment,
# reverted; without it H:N is H): serving_overhead.py's short request on the fresh server (twice), then
# vLLM's prefix_repetition client
# (4 x 1536 + 256, 64 out, 48 prompts, concurrency 4), then the short request again (twice). Prints one line per pass, with the
# client's request throughput and median TPOT.
cd /work/main
D=$1; ROUNDS=${2:-2}
over() { .venv/bin/python benchmarks/serving_overhead.py --base-url http://127.0.0.1:8200 --model tiny-llama --json /tmp/so.json > /dev/null 2>&1; python3 -c "import json; print(json.load(open('/tmp/so.json'))['short_request_ms'])"; }
for r in $(seq $ROUNDS); do for m in ${3:-1 0}; do
  h=${m%%:*}; n=${m#*:}; [ "$n" = "$m" ] && n=
  XP_HELPER_NICE=$n PREFIXSERVE_STEP_HELPER=$h /tmp/start_ps.sh $D > /dev/null
  a=$(over); b=$(over)
  env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_TARGET_DEVICE=cpu /work/vllm-venv/bin/python benchmarks/vllm_wrapper.py bench serve --backend openai --base-url http://127.0.0.1:8200 --model tiny-llama --tokenizer benchmarks/.scratch/tiny-llama-512x8 --dataset-name prefix_repetition --prefix-repetition-prefix-len 1536 --prefix-repetition-suffix-len 256 --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 64 --num-prompts 48 --max-concurrency 4 --ignore-eos --seed 0 --save-result --result-dir /tmp --result-filename sa.json > /dev/null 2>&1
  c=$(over); d=$(over)
  w=$(python3 -c "import json; d = json.load(open('/tmp/sa.json')); print(round(d['request_throughput'], 2), round(d['median_tpot_ms'], 2))")
  echo "$D round $r helper $h nice ${n:-0}: short ms fresh $a $b, after the workload $c $d; workload req/s, TPOT ms $w"
  kill $(cat /tmp/ps.pid); while pgrep -f "cluster serve" >/dev/null; do sleep 1; done; sleep 2
done; done
