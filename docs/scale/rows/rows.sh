#!/bin/bash
# $1 tag; $2 state order ("training-v1 training" or reversed)
# Runs of docs/scale.md's "Per-rank state as rows of one tensor": rows.sh r1 "training-v1 training",
# then rows.sh r2 "training training-v1", each under `flock /tmp/bench.lock` (mkdir -p /tmp/b19).
# Both states are measured by the same code: training-v1 simulates schema 1's per-rank keys.
cd "$(dirname "$0")/../../.."
for st in $2; do
  echo "=== $st $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  PYTHONPATH=. .venv/bin/python benchmarks/bench_scale.py --no-memory --methods v2 --state $st --layouts 70B --ranks 64,256,1024,4096,8192,16384 --repeats 3 --json /tmp/b19/rows_${st}_$1.json
done
echo "=== end $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
