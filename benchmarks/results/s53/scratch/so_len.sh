#!/bin/bash
# serving_overhead.py at output lengths 64 and 256, twice each, on one server of the 0.5B shape (bf16)
#   benchmarks/results/s53/scratch/so_len.sh [HELPER]
source "$(dirname "$0")/q05_server.sh"
helper=${1:-1}
start_q05 $helper /tmp/so_len_server.log
for len in 64 256 64 256; do
  printf '{"helper": %s, "output_len": %s} ' $helper $len
  .venv/bin/python benchmarks/serving_overhead.py --base-url http://127.0.0.1:8300 --model tiny-llama --output-len $len --repeats 5 | tr -d '\n '; echo
done
stop_q05
