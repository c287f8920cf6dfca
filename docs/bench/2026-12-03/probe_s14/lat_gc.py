"""bench.latency with the launcher's garbage collections logged (gen, ms, at)."""
import gc, sys, time, runpy
sys.path.insert(0, ".")
log = []
_start = [0.0]
def cb(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        log.append((time.time(), info["generation"], (time.perf_counter() - _start[0]) * 1e3, info["collected"]))
gc.callbacks.append(cb)
import atexit
def report():
    big = [x for x in log if x[1] == 2]
    print(f"launcher GC: {len(log)} collections; gen2: {len(big)}; gen2 ms: " + ", ".join(f"{m:.0f}" for _, _, m, _ in big[-30:]))
    with open(sys.argv[-1] + ".gc", "w") as f:
        for t, g, m, c in log:
            if m > 2: f.write(f"{t:.3f},{g},{m:.1f},{c}\n")
atexit.register(report)
sys.argv = ["bench.latency"] + sys.argv[1:]
runpy.run_module("bench.latency", run_name="__main__")
