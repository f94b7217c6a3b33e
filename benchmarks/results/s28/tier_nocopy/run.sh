#!/bin/bash
# Session 28: routing on the shared tier's contents with peer copy off (--no-enable-dp-cross-replica-prefix-copy),
# where the tier is the only way a replica gets another replica's pages (issue 12). Tier-blind against tier-priced,
# both with the replicas' measured costs; a shared host tier of 8192 pages; pools x0.35 (the prefixes no longer fit).
# 8 seeds. From the repo root.
export PYTHONPATH=.
OUT=benchmarks/results/s28/tier_nocopy
for w in llmd-prefix multi-turn sglang-gsp zipf; do
  .venv/bin/python -m benchmarks.router_sim compare --workloads $w --dp 4,16 --scale 0.5 --cost-model calibrated \
      --routers prefixserve-measured-nocopy,prefixserve-tier-nocopy --host-tier-pages 8192 --pool-fraction 0.35 \
      --seeds 0,1,2,3,4,5,6,7 --out $OUT/$w > $OUT/$w.log 2>&1
done
# The same points with peer copy on (the default), tier-blind (as deployed) and tier-priced: where the router already
# prices moves as peer copies
for w in llmd-prefix multi-turn sglang-gsp zipf; do
  .venv/bin/python -m benchmarks.router_sim compare --workloads $w --dp 4,16 --scale 0.5 --cost-model calibrated \
      --routers prefixserve-measured,prefixserve-tier --host-tier-pages 8192 --pool-fraction 0.35 \
      --seeds 0,1,2,3,4,5,6,7 --out $OUT/copy-on-$w > $OUT/copy-on-$w.log 2>&1
done
