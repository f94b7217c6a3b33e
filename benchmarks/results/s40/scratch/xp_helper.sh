#!/usr/bin/env bash
# xp_helper.sh DTYPE SETTINGS...: per setting (XP_HELPER_MIN value), a server, short requests and streams; 2 rounds
D=$1; shift
for round in 1 2; do
for hm in "$@"; do
  XP_HELPER_MIN=$hm /tmp/start_ps.sh $D > /dev/null
  cd /work/main
  s=$(PYTHONPATH=benchmarks .venv/bin/python benchmarks/results/s40/scratch/short_cpu.py http://127.0.0.1:8200 400 2>/dev/null | head -2 | tr '\n' ' ')
  t1=$(PYTHONPATH=benchmarks .venv/bin/python benchmarks/stream_cpu.py --base-url http://127.0.0.1:8200 --model tiny-llama --streams 1 --output-len 128 --rounds 2 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print(d.get('median_tpot_ms'))")
  t4=$(PYTHONPATH=benchmarks .venv/bin/python benchmarks/stream_cpu.py --base-url http://127.0.0.1:8200 --model tiny-llama --streams 4 --output-len 128 --rounds 2 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print(d.get('median_tpot_ms'))")
  echo "round $round helper_min $hm | $s | tpot1 $t1 tpot4 $t4"
  kill $(cat /tmp/ps.pid); while pgrep -f "cluster serve" >/dev/null; do sleep 1; done; sleep 2
done; done
