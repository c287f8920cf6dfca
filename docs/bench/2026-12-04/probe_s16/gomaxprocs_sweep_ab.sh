#!/bin/bash
# nats-server with GOMAXPROCS=1 against the default (2 here), read as bench.latency's sweep knee;
# three pairs, alternating which goes first. nats-server inherits the bench's environment.
cd "$(dirname "$0")/../../../.."
RATES=${RATES:-400,600,700,800,900,1000}
one() {  # $1 = label, rest = env
  local label=$1; shift
  echo "=== $label $(date +%T)"
  env "$@" .venv/bin/python -m bench.latency --drain-only --seconds 12 --low-runs 50 \
      --capacity-runs 3000 --rates $RATES | grep -E "capacity \(drain\)|ms CPU/run|^\| +[0-9,]+ \||sweep:"
}
for pair in 1 2 3; do
  if (( pair % 2 )); then one default X=1; one gomaxprocs1 GOMAXPROCS=1
  else one gomaxprocs1 GOMAXPROCS=1; one default X=1; fi
done
echo DONE
