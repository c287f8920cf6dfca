#!/bin/bash
cd /work/main
for i in 1 2 3; do
  for mode in disk tmpfs; do
    if [ $((i % 2)) = 0 ]; then m=$([ $mode = disk ] && echo tmpfs || echo disk); else m=$mode; fi
    if [ $m = tmpfs ]; then export TMPDIR=/dev/shm; else unset TMPDIR; fi
    echo "== pair $i $m $(date +%T)" >> /tmp/ab_tmpfs.log
    timeout 400 .venv/bin/python -m bench.latency --dump /tmp/ab_tmpfs_${i}_$m.csv 2>&1 | grep -E "SUMMARY|capacity" | tail -3 >> /tmp/ab_tmpfs.log
  done
done
echo done >> /tmp/ab_tmpfs.log
