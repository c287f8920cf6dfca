#!/bin/bash
# interleaved window (as docs/bench/2026-12-03/window_interleaved_s12.sh), runfleet from a snapshot
TAG=$1
SNAP=/tmp/benchsnap
PY=/work/main/.venv/bin/python
: > /tmp/w_${TAG}_rf.txt; : > /tmp/w_${TAG}_peers.txt; : > /tmp/w_${TAG}_files.txt
bash /tmp/peer/pg.sh start >/dev/null 2>&1
for i in 1 2 3; do
  (cd $SNAP && PYTHONPATH=$SNAP $PY -m bench.throughput --rounds 1 --count-runs 0) >> /tmp/w_${TAG}_rf.txt 2>&1
  (cd /tmp/peer && E2E_N=2000 COUNT_N=0 ./run_all.sh 5000 1 dbos-postgres dbos-sqlite-wal procrastinate pgqueuer) >> /tmp/w_${TAG}_peers.txt 2>&1
  ls -t /tmp/peer/results/*.jsonl | head -1 >> /tmp/w_${TAG}_files.txt
done
bash /tmp/peer/pg.sh stop >/dev/null 2>&1
echo DONE >> /tmp/w_${TAG}_peers.txt
: > /tmp/w_${TAG}_latency.txt
for i in 1 2 3; do
  (cd $SNAP && PYTHONPATH=$SNAP $PY -m bench.latency) >> /tmp/w_${TAG}_latency.txt 2>&1
done
(cd $SNAP && PYTHONPATH=$SNAP $PY -m bench.latency --drain-only --rates 200,400,600,800,1000) >> /tmp/w_${TAG}_latency.txt 2>&1
echo DONE >> /tmp/w_${TAG}_latency.txt
