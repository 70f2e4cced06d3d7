#!/bin/bash
# $1 tag; $2 state order ("training-no-rng training" or reversed)
# Runs of docs/scale.md's "Without the generators": norng.sh r1 "training-no-rng training", then
# norng.sh r2 "training training-no-rng", each under `flock /tmp/bench.lock` (mkdir -p /tmp/b19).
cd "$(dirname "$0")/../../.."
for st in $2; do
  echo "=== $st $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  PYTHONPATH=. .venv/bin/python benchmarks/bench_scale.py --no-memory --methods v2 --state $st --layouts 70B --ranks 4096,16384 --repeats 3 --json /tmp/b19/norng_${st}_$1.json
done
echo "=== end $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
