"""CPU of each process/thread per 100 ms around the tail buckets. argv: cpu.csv lat.csv"""
import csv, sys, collections
rows = list(csv.DictReader(open(sys.argv[1])))
lat = list(csv.DictReader(open(sys.argv[2])))
t0 = min(float(r["published_at"]) for r in lat)
# deltas per (pid,tid)
prev = {}; buckets = collections.defaultdict(lambda: collections.defaultdict(float))
names = {}
for r in rows:
    k = (r["pid"], r["tid"]); t = float(r["t"]); ns = int(r["ns"])
    names[k] = (r["cmd"][-25:], r["thread"])
    if k in prev:
        pt, pns = prev[k]
        buckets[round((t - t0) * 10)][k] += (ns - pns) / 1e6
    prev[k] = (t, ns)
# per process per bucket
procs = sorted({k[0] for k in names})
pname = {p: next(names[k][0] for k in names if k[0] == p) for p in procs}
print("t(s)  " + " | ".join(f"{pname[p]}" for p in procs))
lo, hi = float(sys.argv[3]), float(sys.argv[4])
for b in sorted(buckets):
    if lo * 10 <= b <= hi * 10:
        per = collections.defaultdict(float)
        top = max(buckets[b].items(), key=lambda kv: kv[1])
        for k, v in buckets[b].items(): per[k[0]] += v
        print(f"{b/10:5.1f} " + " | ".join(f"{per[p]:6.1f}" for p in procs) + f"   top thread {names[top[0]]} {top[1]:.1f}ms")
