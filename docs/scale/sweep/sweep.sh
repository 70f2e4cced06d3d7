#!/bin/bash
# $1: run tag; $2: ranks list
cd /work/main
for st in bare training; do
  echo "=== $st $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  PYTHONPATH=. .venv/bin/python benchmarks/bench_scale.py --no-memory --methods v2 --state $st --layouts 70B --ranks $2 --repeats 3 --json /tmp/b19/sweep_${st}_$1.json
done
echo "=== end $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
