#!/bin/bash
# Alternating pairs of bench.throughput (drain and e2e, 1 round each): before = 9699612, after = HEAD.
cd /work/main
for i in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then dir=/tmp/before; else dir=/work/main; fi
    echo "=== pair $i $side $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python -m bench.throughput --rounds 1 --runs 5000 --e2e-runs 2000 --count-runs 20 2>&1 | grep -E "SUMMARY")
  done
done
