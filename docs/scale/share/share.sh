#!/bin/bash
# $1 tag; $2 fwd|rev. "before": cfac7b1's package (before the share pause and entry pickling)
# Runs of docs/scale.md's "The record a load's ranks receive": share.sh _r1 fwd, then share.sh _r2 rev,
# each under `flock /tmp/bench.lock`; "before" is cfac7b1's package:
#   mkdir -p /tmp/sharebefore /tmp/b19 && git archive cfac7b1 goodput_ckpt | tar -x -C /tmp/sharebefore
cd "$(dirname "$0")/../../.."
S=$1
run() { tag=$1; path=$2; shift 2; echo "=== $tag $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"; PYTHONPATH=$path .venv/bin/python benchmarks/bench_scale.py --no-memory --methods v2 "$@" --json /tmp/b19/share_$tag$S.json; }
pair() { name=$1; shift
  if [ "$ORDER" = rev ]; then run before_$name /tmp/sharebefore:. "$@"; run after_$name . "$@"; else run after_$name . "$@"; run before_$name /tmp/sharebefore:. "$@"; fi; }
ORDER=$2
pair t16k --state training --layouts 70B --ranks 16384 --repeats 3
pair t4k --state training --layouts 70B --ranks 4096 --repeats 3
pair b16k --state bare --layouts 70B --ranks 16384 --repeats 3
echo "=== end $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
