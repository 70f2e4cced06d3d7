#!/bin/bash
# The runs of docs/scale.md's "A training job's per-rank items": run.sh _r1 fwd, then run.sh _r2 rev,
# each under `flock /tmp/bench.lock`. "Before" is commit 19d3ea3's package:
#   mkdir -p /tmp/s19old /tmp/b19 && git archive 19d3ea3 goodput_ckpt | tar -x -C /tmp/s19old
# $1: tag suffix; $2: "fwd" (after first) or "rev" (before first)
cd "$(dirname "$0")/../../.."
B="benchmarks/bench_scale.py --no-memory --methods v2"
NEW=.
OLD=/tmp/s19old:.
S=$1
run() { tag=$1; path=$2; shift 2; echo "=== $tag $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"; PYTHONPATH=$path .venv/bin/python $B "$@" --json /tmp/b19/$tag$S.json; }
pair() { # name, args...
  name=$1; shift
  if [ "$ORDER" = rev ]; then run before_$name $OLD "$@"; run after_$name $NEW "$@"; else run after_$name $NEW "$@"; run before_$name $OLD "$@"; fi
}
ORDER=$2
pair t1k --state training --layouts 70B --ranks 1024 --repeats 5
pair b16k --state bare --layouts 70B --ranks 16384 --repeats 3
pair b405 --state bare --layouts 405B --ranks 4096 --repeats 3
run after_t4k $NEW --state training --layouts 70B --ranks 4096 --repeats 3
run after_t16k $NEW --state training --layouts 70B --ranks 16384 --repeats 3
run after_t405 $NEW --state training --layouts 405B --ranks 4096 --repeats 3
echo "=== end $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
