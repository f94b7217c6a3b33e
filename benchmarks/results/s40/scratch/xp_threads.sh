#!/usr/bin/env bash
# xp_threads.sh DTYPE: short requests over HTTP, three settings alternated twice
D=$1
for round in 1 2; do
for setting in "64:" "8:" "8:10000"; do
  mt=${setting%%:*}; sc=${setting#*:}
  if [ -n "$sc" ]; then export GOMP_SPINCOUNT=$sc; else unset GOMP_SPINCOUNT; fi
  XP_MIN_TOKENS=$mt /tmp/start_ps.sh $D > /dev/null
  echo "== round $round min_tokens $mt spincount ${sc:-default}"
  cd /work/main && PYTHONPATH=benchmarks .venv/bin/python benchmarks/results/s40/scratch/short_cpu.py http://127.0.0.1:8200 400 | head -5
  kill $(cat /tmp/ps.pid); while pgrep -f "cluster serve" >/dev/null; do sleep 1; done; sleep 2
done; done
