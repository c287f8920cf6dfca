#!/bin/bash
# WAL checkpointer interval A/B: 0.1 s (current) vs $2, alternating, $1 pairs, open loop at $3 runs/s.
cd /work/main
out=/tmp/ab_ckpt_$2_$3.txt; : > $out
for i in $(seq 1 $1); do
  for iv in 0.1 $2; do
    sed -i "s/^INTERVAL_S = .*/INTERVAL_S = $iv/" store/sqlite/checkpointer.py
    echo "=== pair $i interval $iv $(date -u +%H:%M:%S)" >> $out
    rm -f /tmp/abc_$iv_$i.csv
    timeout 600 .venv/bin/python -m bench.latency --drain-only --rate $3 --capacity-runs 2000 --low-runs 50 --seconds 30 --dump /tmp/abc_${iv}_$i.csv 2>&1 | grep -E "CPU/run|SUMMARY|fixed rate \(" >> $out
    .venv/bin/python /tmp/lp/tail_clusters.py /tmp/abc_${iv}_$i.csv >> $out 2>&1
  done
done
sed -i "s/^INTERVAL_S = .*/INTERVAL_S = 0.1/" store/sqlite/checkpointer.py
echo "=== done $(date -u +%H:%M:%S)" >> $out
