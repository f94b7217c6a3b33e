#!/usr/bin/env bash
# README's `prefixserve serve` (/tmp/serve_check.sh: /health, a completion, a stream, a 404, SIGTERM), main's replica
# code (git checkout BASE -- replica/) and the tree's taking turns in this checkout (the editable install runs it).
# Usage: serve_ab.sh BASE ROUNDS
set -u
base=$1; rounds=${2:-3}
head=$(git rev-parse HEAD)
for round in $(seq "$rounds"); do
  for side in tree main; do
    if [ $side = main ]; then git checkout -q "$base" -- replica/; else git checkout -q "$head" -- replica/; fi
    bash /tmp/serve_check.sh > /tmp/serve_ab_one.txt 2>&1
    echo "$side: $(grep -h 'health after' /tmp/serve_ab_one.txt), $(grep -o 'started in [0-9.]* s, its compiled forward ready in [0-9.]* s' /tmp/serve_check.log), $(grep -h 'exit code' /tmp/serve_ab_one.txt)"
    sleep 2
  done
done
git checkout -q "$head" -- replica/
