"""Every sample with a thread in D state (uninterruptible, i.e. disk) and gaps in the sampler
itself (> 120 ms between samples: the machine did not schedule it), relative to the phase's
first publish. argv: proc.csv lat.csv"""
import csv, sys, collections
rows = list(csv.DictReader(open(sys.argv[1])))
lat = list(csv.DictReader(open(sys.argv[2])))
starts = {}
for r in lat: starts[r["phase"]] = min(starts.get(r["phase"], 1e18), float(r["published_at"]))
def where(t):
    best = None
    for ph, t0 in starts.items():
        if t >= t0 - 1 and (best is None or t0 > starts[best]): best = ph
    return f"{best[:12]}+{t - starts[best]:.2f}s" if best else f"{t:.2f}"
ts = sorted({float(r["t"]) for r in rows})
for a, b in zip(ts, ts[1:]):
    if b - a > 0.12: print(f"sampler gap {(b-a)*1e3:.0f} ms at {where(a)}")
for r in rows:
    if r["state"] == "D" and r["kind"] in ("nats", "runner", "launcher"):
        print(f"D {where(float(r['t']))} {r['kind']}/{r['name']} @{r['wchan']}")
