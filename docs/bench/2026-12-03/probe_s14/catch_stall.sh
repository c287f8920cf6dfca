#!/bin/bash
# Full bench.latency runs, each with the /proc sampler beside it, to catch a stall in the act.
cd /work/main
for i in $(seq 1 ${1:-4}); do
  rm -f /tmp/cs$i.csv /tmp/cs${i}_proc.csv
  python3 /tmp/lp/proc_sampler.py 110 /tmp/cs${i}_proc.csv &
  sp=$!
  timeout 900 .venv/bin/python -m bench.latency --dump /tmp/cs$i.csv > /tmp/cs$i.txt 2>&1
  kill $sp 2>/dev/null; wait $sp 2>/dev/null
  .venv/bin/python /tmp/lp/tail_clusters.py /tmp/cs$i.csv >> /tmp/cs$i.txt
done
echo done > /tmp/cs.done
