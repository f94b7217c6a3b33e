#!/usr/bin/env bash
# s30's commit (4128518) against main's working tree, alternated, vLLM's client against prefixserve only, float32
for i in 1 2; do
  TAGX=at30-$i
  (sleep 120; for p in $(pgrep -f ServeReplica); do echo "$TAGX pid $p: $(grep -o 'prefixserve_cpu[^/]*' /proc/$p/maps | sort -u | tr '\n' ' ') $(tr '\0' '\n' < /proc/$p/environ | grep ^PYTHONPATH)"; done >> /tmp/ab30_check.txt) &
  (cd /work/wt30 && PYTHONPATH=/work/wt30 SCRATCH=/work/main/benchmarks/.scratch RESULTS=/work/main/benchmarks/results \
    PROJECT_PY=/work/main/.venv/bin/python DTYPE=float32 VC_SERVERS=prefixserve VC_TAG=-s35at30-$i \
    VLLM_VENV=/work/vllm-venv bash benchmarks/vs_vllm.sh vllm-client)
  echo "at30-$i: $(grep -o 'linear layers[^;]*' /work/main/benchmarks/.scratch/logs/float32/prefixserve-caching-on.log | head -1)"
  echo "at30-$i: $(grep -o 'small-row[^,;]*' /work/main/benchmarks/.scratch/logs/float32/prefixserve-caching-on.log | head -1)"
  TAGX=head-$i
  (sleep 120; for p in $(pgrep -f ServeReplica); do echo "$TAGX pid $p: $(grep -o 'prefixserve_cpu[^/]*' /proc/$p/maps | sort -u | tr '\n' ' ') $(tr '\0' '\n' < /proc/$p/environ | grep ^PYTHONPATH)"; done >> /tmp/ab30_check.txt) &
  (cd /work/main && DTYPE=float32 VC_SERVERS=prefixserve VC_TAG=-s35head-$i VLLM_VENV=/work/vllm-venv \
    bash benchmarks/vs_vllm.sh vllm-client)
  echo "head-$i: $(grep -o 'small-row[^,;]*' /work/main/benchmarks/.scratch/logs/float32/prefixserve-caching-on.log | head -1)"
done
