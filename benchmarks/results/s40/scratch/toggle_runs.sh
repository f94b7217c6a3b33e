#!/usr/bin/env bash
# one server per dtype; short requests (helper_ab.py, 6 blocks x 150) and streams (1 and 4), helper toggled by a file
cd /work/main
out=benchmarks/results/s40/helper_toggle.txt
echo "# $(date -u +%FT%TZ) benchmarks/results/s40/scratch/toggle_runs.sh: one server per dtype (scratch/start_ps.sh), the" > $out
echo "# helper switched per block by /tmp/xp_helper_off (a temporary check in LLMEngine._set_step_threads, not committed)" >> $out
for D in float32 bfloat16; do
  /tmp/start_ps.sh $D > /dev/null
  echo "== $D short requests: PYTHONPATH=benchmarks .venv/bin/python benchmarks/results/s40/scratch/helper_ab.py http://127.0.0.1:8200 6 150" >> $out
  PYTHONPATH=benchmarks .venv/bin/python benchmarks/results/s40/scratch/helper_ab.py http://127.0.0.1:8200 6 150 >> $out 2>&1
  echo "== $D streams: benchmarks/stream_cpu.py --streams S --output-len 128 --rounds 2, median TPOT ms" >> $out
  for b in 1 2 3; do for mode in on off; do
    [ $mode = off ] && touch /tmp/xp_helper_off || rm -f /tmp/xp_helper_off
    for s in 1 4; do
      t=$(PYTHONPATH=benchmarks .venv/bin/python benchmarks/stream_cpu.py --base-url http://127.0.0.1:8200 --model tiny-llama --streams $s --output-len 128 --rounds 2 2>/dev/null | python3 -c "import json,sys; print(json.load(sys.stdin)['median_tpot_ms'])")
      echo "block $b helper $mode streams $s tpot $t" >> $out
    done
  done; done
  rm -f /tmp/xp_helper_off
  kill $(cat /tmp/ps.pid); while pgrep -f "cluster serve" >/dev/null; do sleep 1; done; sleep 2
done
echo done >> $out
