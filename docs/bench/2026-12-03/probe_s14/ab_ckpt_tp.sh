#!/bin/bash
# WAL checkpointer interval, throughput A/B: 0.1 s vs $2, alternating, $1 pairs.
cd /work/main
out=/tmp/ab_ckpt_tp_$2.txt; : > $out
for i in $(seq 1 $1); do
  for iv in 0.1 $2; do
    sed -i "s/^INTERVAL_S = .*/INTERVAL_S = $iv/" store/sqlite/checkpointer.py
    echo "=== pair $i interval $iv $(date -u +%H:%M:%S)" >> $out
    timeout 900 .venv/bin/python -m bench.throughput --modes drain,e2e --rounds 1 --count-runs 0 --runs 5000 --e2e-runs 2000 2>&1 | grep -E "SUMMARY" >> $out
  done
done
sed -i "s/^INTERVAL_S = .*/INTERVAL_S = 0.1/" store/sqlite/checkpointer.py
echo "=== done $(date -u +%H:%M:%S)" >> $out
