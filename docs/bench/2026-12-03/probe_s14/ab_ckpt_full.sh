#!/bin/bash
# WAL checkpointer interval 0.1 s vs $2, full default bench.latency (both half-load readings), $1 pairs.
cd /work/main
out=docs/bench/2026-12-03/latency_ckpt_interval_ab_s14.txt; : > $out
for i in $(seq 1 $1); do
  for iv in 0.1 $2; do
    sed -i "s/^INTERVAL_S = .*/INTERVAL_S = $iv/" store/sqlite/checkpointer.py
    echo "=== pair $i interval $iv $(date -u +%H:%M:%S)" >> $out
    timeout 900 .venv/bin/python -m bench.latency --dump /tmp/abf_${iv}_$i.csv >> $out 2>&1
    .venv/bin/python /tmp/lp/tail_clusters.py /tmp/abf_${iv}_$i.csv >> $out 2>&1
  done
done
sed -i "s/^INTERVAL_S = .*/INTERVAL_S = 0.1/" store/sqlite/checkpointer.py
echo "=== done $(date -u +%H:%M:%S)" >> $out
