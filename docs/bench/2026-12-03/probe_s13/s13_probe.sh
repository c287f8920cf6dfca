#!/bin/bash
# The thirteenth pass's probes of where half load's CPU goes (run on a quiet machine).
# Usage: cp -r docs/bench/2026-12-03/probe_s13 /tmp/lp && bash /tmp/lp/s13_probe.sh (output: /tmp/lp/probe_s13.txt;
# its run on 9735a0c is half_load_probe_s13.txt). The scripts expect the repository at /work/main.
cd /work/main
OUT=/tmp/lp/probe_s13.txt
: > $OUT
echo "== $(date -u) $(git rev-parse --short HEAD); $(nproc) cpus; load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT
echo "== 1. what a sleep and a wake cost this VM (python3 /tmp/lp/wake.py)" >> $OUT
python3 /tmp/lp/wake.py >> $OUT 2>&1
echo "== 2. context switches per process over 5 s while launching 900 runs/s open-loop into 2 runners x 16 slots" >> $OUT
(.venv/bin/python /tmp/lp/launch_prof2.py 12000 900 > /tmp/lp/probe_run.txt 2>&1 &)
for i in $(seq 200); do grep -q GO /tmp/lp/probe_run.txt 2>/dev/null && break; sleep 0.2; done; sleep 1
python3 /tmp/lp/ctx.py 5 >> $OUT
sleep 1
echo "== 3. perf record -F 999 of one runner for 5 s, same load: CPU by shared object" >> $OUT
p=$(pgrep -f "runfleet runner" | head -1)
perf record -F 999 -p $p -o /tmp/lp/perf_probe.data -- sleep 5 > /dev/null 2>&1
for i in $(seq 200); do grep -q "launches in" /tmp/lp/probe_run.txt && break; sleep 0.2; done
cat /tmp/lp/probe_run.txt >> $OUT
perf report -i /tmp/lp/perf_probe.data --sort dso --stdio 2>/dev/null | grep -v "^#" | grep -v "^$" | head -10 >> $OUT
sleep 10
echo "== 4. raw SQLite: one insert transaction (runs row + 2 events), this schema, one process" >> $OUT
sed -i 's/^for label, other in (("alone", False),):/for label, other in (("alone", False), ("another conn writes between", True)):/' /tmp/lp/rawsql.py
.venv/bin/python /tmp/lp/rawsql.py >> $OUT 2>&1
echo "== 5. a launch's parts, back to back and 1 ms apart, no runners (cd /tmp/lp && python parts.py)" >> $OUT
(cd /tmp/lp && /work/main/.venv/bin/python parts.py) >> $OUT 2>&1
echo "== 6. js.publish against nc.request against a hand-made request (pubvar.py)" >> $OUT
.venv/bin/python /tmp/lp/pubvar.py 2>&1 | grep -v "^{" >> $OUT
echo "== 7. the same work (5 x validate+parse+dump of a run document) hot, and after a sleep of 0.5/2/10 ms (cold.py)" >> $OUT
(cd /tmp/lp && /work/main/.venv/bin/python cold.py) >> $OUT 2>&1
echo "== 8. CPU per run against the open-loop rate: bench.latency --rate R --drain-only --capacity-runs 2000 --seconds 10" >> $OUT
for r in 100 300 600 900; do echo "rate $r:" >> $OUT; .venv/bin/python -m bench.latency --rate $r --drain-only --capacity-runs 2000 --seconds 10 2>&1 | grep -E "busy" | head -1 >> $OUT; done
echo DONE >> $OUT
