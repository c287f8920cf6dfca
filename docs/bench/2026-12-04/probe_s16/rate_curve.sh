#!/bin/bash
# p99 against an open-loop rate: runfleet (bench.latency --rate R --drain-only) and the two
# fastest durable peers (peer_open_loop.py), interleaved per rate, two rounds.
#   bash rate_curve.sh <peer-bench copy> <out prefix>      (the copy's ./pg.sh started)
PEER=${1:-/tmp/peer}; OUT=${2:-/tmp/rate_curve}
HERE=$(cd "$(dirname "$0")" && pwd); MAIN=$(cd "$HERE/../../../.." && pwd)
RATES=${RATES:-"200 400 600 800 1000"}
for round in 1 2; do
  for rate in $RATES; do
    echo "=== round $round rate $rate runfleet $(date +%T)" >> $OUT.runfleet.txt
    (cd "$MAIN" && .venv/bin/python -m bench.latency --rate $rate --drain-only --seconds 20 \
        --capacity-runs 3000 --low-runs 50) >> $OUT.runfleet.txt 2>&1
    for peer in pgqueuer procrastinate; do
      "$PEER/venv/bin/python" "$HERE/peer_open_loop.py" --peer-dir "$PEER" --peer $peer \
          --rate $rate --seconds 20 2>> $OUT.peers.stderr | tail -1 >> $OUT.peers.jsonl
    done
  done
done
echo DONE >> $OUT.runfleet.txt
