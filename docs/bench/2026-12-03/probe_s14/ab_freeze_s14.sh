#!/bin/bash
# bench.latency, full default phases, launcher frozen (new) vs --no-freeze (old), 3 alternating pairs.
cd /work/main
out=docs/bench/2026-12-03/latency_freeze_ab_s14.txt
: > $out
for i in 1 2 3; do
  for mode in old new; do
    flag=""; [ $mode = old ] && flag="--no-freeze"
    echo "=== pair $i: $mode ($flag) $(date -u +%H:%M:%S)" >> $out
    rm -f /tmp/ab_$mode$i.csv
    timeout 1200 .venv/bin/python -m bench.latency $flag --dump /tmp/ab_$mode$i.csv >> $out 2>&1
    .venv/bin/python /tmp/lp/tail_clusters.py /tmp/ab_$mode$i.csv >> $out 2>&1
  done
done
echo "=== done $(date -u +%H:%M:%S)" >> $out
