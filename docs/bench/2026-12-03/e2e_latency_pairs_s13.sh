#!/bin/bash
# e2e latency like for like: runfleet's launch call -> finished against the peers' enqueue call ->
# completion, interleaved: runfleet e2e round, then PgQueuer and Procrastinate (run_all.sh), x3.
: > /tmp/e2el_rf.txt; : > /tmp/e2el_peers.txt; : > /tmp/e2el_files.txt
bash /tmp/peer/pg.sh start >/dev/null 2>&1
for i in 1 2 3; do
  (cd /work/main && .venv/bin/python -m bench.throughput --modes e2e --rounds 1 --count-runs 0 --e2e-runs 2000) >> /tmp/e2el_rf.txt 2>&1
  (cd /tmp/peer && E2E_N=2000 COUNT_N=0 ./run_all.sh 5000 1 pgqueuer procrastinate) >> /tmp/e2el_peers.txt 2>&1
  ls -t /tmp/peer/results/*.jsonl | head -1 >> /tmp/e2el_files.txt
done
bash /tmp/peer/pg.sh stop >/dev/null 2>&1
echo DONE >> /tmp/e2el_peers.txt
