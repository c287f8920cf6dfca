#!/bin/bash
# py-spy of both runners and the launcher during bench.latency's fixed-rate phase
cd /work/main
OUT=/tmp/s16/prof_${RATE:-1000}; rm -rf $OUT; mkdir -p $OUT
.venv/bin/python -m bench.latency --rate ${RATE:-1000} --drain-only --seconds 25 --capacity-runs 3000 --low-runs 50 > $OUT/latency.txt 2>&1 &
LPID=$!
until grep -q "low load:" $OUT/latency.txt; do sleep 0.5; done
sleep 3
for pid in $(pgrep -f "runfleet runner --slots"); do
  .venv/bin/py-spy record -p $pid -r 100 -d 12 -f raw --nonblocking -o $OUT/runner-$pid.txt > /dev/null 2>&1 &
done
.venv/bin/py-spy record -p $LPID -r 100 -d 12 -f raw --nonblocking -o $OUT/launcher.txt > /dev/null 2>&1 &
wait
echo DONE
