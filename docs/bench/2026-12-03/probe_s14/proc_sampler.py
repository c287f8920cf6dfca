"""Every 40 ms for D seconds: each python (runfleet/bench) and nats-server thread's CPU ns,
state (R/S/D) and wchan; the WAL sizes; Dirty and Writeback from /proc/meminfo. argv: D out.csv"""
import glob, os, sys, time
D = float(sys.argv[1]); out = open(sys.argv[2], "w")
out.write("t,kind,pid,tid,name,ns,state,wchan\n")
def pids():
    res = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "nats-server" in cmd: res.append((pid, "nats"))
        elif "python" in cmd and "runfleet runner" in cmd or "-m runner runner" in cmd: res.append((pid, "runner"))
        elif "python" in cmd and "bench." in cmd: res.append((pid, "launcher"))
    return res
known = pids(); last_scan = time.time()
end = time.time() + D
while time.time() < end:
    now = time.time()
    if now - last_scan > 1: known = pids(); last_scan = now
    for pid, kind in known:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                st = open(f"/proc/{pid}/task/{tid}/stat").read()
                name = st[st.index("(") + 1:st.rindex(")")].replace(",", " ")
                state = st[st.rindex(")") + 2]
                ns = open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0]
                try: wchan = open(f"/proc/{pid}/task/{tid}/wchan").read().strip() or "-"
                except OSError: wchan = "?"
                out.write(f"{now:.3f},{kind},{pid},{tid},{name},{ns},{state},{wchan}\n")
        except OSError:
            pass
    for w in glob.glob("/tmp/runfleet-bench-*/**/*-wal", recursive=True):
        try: out.write(f"{now:.3f},wal,0,0,{os.path.basename(w)},{os.path.getsize(w)},-,-\n")
        except OSError: pass
    mem = dict(l.split(":", 1) for l in open("/proc/meminfo"))
    out.write(f"{now:.3f},mem,0,0,dirty_wb_kb,{int(mem['Dirty'].split()[0])},{int(mem['Writeback'].split()[0])},-\n")
    time.sleep(0.04)
