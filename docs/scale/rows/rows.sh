#!/bin/bash
# $1 tag; $2 state order ("training-v1 training" or reversed); $3 layout (default 70B);
# $4 world sizes (default 64,256,1024,4096,8192,16384).
# Runs of docs/scale.md's "Per-rank state as rows of one tensor": rows.sh r1 "training-v1 training",
# then rows.sh r2 "training training-v1", each under `flock /tmp/bench.lock` (mkdir -p /tmp/b19);
# 405B: rows.sh r1 "training-v1 training" 405B 1024,4096,16384 (and r2 reversed).
# Both states are measured by the same code: training-v1 simulates schema 1's per-rank keys.
cd "$(dirname "$0")/../../.."
layout=${3:-70B}
ranks=${4:-64,256,1024,4096,8192,16384}
suffix=$([ "$layout" = 70B ] && echo "" || echo "_$layout")
for st in $2; do
  echo "=== $st $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  PYTHONPATH=. .venv/bin/python benchmarks/bench_scale.py --no-memory --methods v2 --state $st --layouts $layout --ranks $ranks --repeats 3 --json /tmp/b19/rows_${st}${suffix}_$1.json
done
echo "=== end $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
