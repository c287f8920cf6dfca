"""Per 40 ms sample around a stall: CPU ms of each kind since the previous sample, threads in D
state (with wchan), dirty/writeback KB, WAL MB. argv: proc.csv lat.csv phase from_s to_s"""
import csv, sys, collections
rows = list(csv.DictReader(open(sys.argv[1])))
lat = [r for r in csv.DictReader(open(sys.argv[2])) if r["phase"].startswith(sys.argv[3])]
t0 = min(float(r["published_at"]) for r in lat)
lo, hi = float(sys.argv[4]), float(sys.argv[5])
by_t = collections.defaultdict(list)
for r in rows: by_t[r["t"]].append(r)
prev = {}
for t in sorted(by_t, key=float):
    rel = float(t) - t0
    cpu = collections.defaultdict(float); dstate = []; extra = ""
    running = collections.Counter()
    for r in by_t[t]:
        if r["kind"] in ("nats", "runner", "launcher"):
            k = (r["pid"], r["tid"]); ns = int(r["ns"])
            if k in prev: cpu[f'{r["kind"]}:{r["pid"]}'] += (ns - prev[k]) / 1e6
            prev[k] = ns
            if r["state"] == "D": dstate.append(f'{r["kind"]}/{r["name"]}@{r["wchan"]}')
            if r["state"] == "R": running[r["kind"]] += 1
        elif r["kind"] == "mem": extra += f' dirty {int(r["ns"])//1024}MB wb {int(r["state"])//1024}MB'
        elif r["kind"] == "wal": extra += f' {r["name"][-12:]} {int(r["ns"])/1e6:.0f}MB'
    if lo <= rel <= hi:
        print(f"{rel:6.2f} " + " ".join(f"{k}={v:4.1f}" for k, v in sorted(cpu.items())) + f" R={dict(running)} D={dstate}{extra}")
# latency of runs published in window
print("runs published in window, finished ms by 50 ms:")
b = collections.defaultdict(list)
for r in lat:
    rel = float(r["published_at"]) - t0
    if lo <= rel <= hi: b[int(rel * 20)].append(float(r["finished_ms"]))
print(" ".join(f"{k/20:.2f}:{max(v):.0f}" for k, v in sorted(b.items())))
