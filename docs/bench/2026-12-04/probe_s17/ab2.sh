#!/bin/bash
cd /work/main
for i in 1 2 3 4; do
  for side in after before; do
    if [ $side = before ]; then dir=/tmp/before; else dir=/work/main; fi
    echo "=== pair $i $side $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python -m bench.throughput --rounds 1 --modes e2e --e2e-runs 3000 --count-runs 20 2>&1 | grep -E "SUMMARY")
  done
done
