"""Where in time the tail of a bench.latency --dump CSV fell (250 ms buckets)."""
import csv, sys, collections
rows = [r for r in csv.DictReader(open(sys.argv[1]))]
for phase in dict.fromkeys(r["phase"] for r in rows):
    rs = [r for r in rows if r["phase"] == phase]
    t = [float(r["t_s"]) for r in rs]; d = [float(r["finished_ms"]) for r in rs]
    p99 = sorted(d)[int(len(d) * 0.99)]
    b = collections.defaultdict(list)
    for ti, di in zip(t, d):
        b[int(ti * 4)].append(di)
    hot = [f"{k/4:.2f}s:max {max(v):.0f}ms/{sum(1 for x in v if x >= p99)}" for k, v in sorted(b.items()) if any(x >= p99 for x in v)]
    print(f"{phase}: n={len(d)} p50={sorted(d)[len(d)//2]:.1f} p99={p99:.1f} ms; buckets holding the p99 tail:")
    print("  " + "  ".join(hot))
