#!/bin/bash
# README's server on the 0.5B shape (bf16), stream_cpu.py with one stream: the CPU each process and thread spends per token
#   benchmarks/results/s53/scratch/stream_cpu_q05.sh [HELPER]
source "$(dirname "$0")/q05_server.sh"
start_q05 "${1:-1}" /tmp/stream_cpu_server.log
.venv/bin/python benchmarks/stream_cpu.py --base-url http://127.0.0.1:8300 --model tiny-llama --streams 1 --output-len 256 --rounds 2
stop_q05
