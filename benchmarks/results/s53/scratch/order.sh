#!/bin/bash
# stream_cpu.py's TPOT before and after serving_overhead.py, on one server of the 0.5B shape (bf16)
#   benchmarks/results/s53/scratch/order.sh [HELPER]
source "$(dirname "$0")/q05_server.sh"
start_q05 "${1:-1}" /tmp/order_server.log
sc() { .venv/bin/python benchmarks/stream_cpu.py --base-url http://127.0.0.1:8300 --model tiny-llama --streams 1 --output-len 128 --rounds 3 | python3 -c "import json,sys; d=json.load(sys.stdin); print('stream_cpu tpot', d['median_tpot_ms'])"; }
sc; sc
.venv/bin/python benchmarks/serving_overhead.py --base-url http://127.0.0.1:8300 --model tiny-llama --repeats 8 | tr -d '\n '; echo
sc
stop_q05
