"""Sample every python / nats-server process's CPU each 20 ms for D seconds; print the per-100 ms
CPU of each, so a periodic burst shows which process made it. argv: seconds out.csv"""
import os, sys, time
D = float(sys.argv[1]); out = open(sys.argv[2], "w")
tick = os.sysconf("SC_CLK_TCK")
def procs():
    res = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try:
            cmd = open(f"/proc/{pid}/cmdline","rb").read().replace(b"\0", b" ").decode()
            if ("python" in cmd and ("runfleet" in cmd or "bench" in cmd) ) or "nats-server" in cmd:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    st = open(f"/proc/{pid}/task/{tid}/stat").read()
                    name = st[st.index("(")+1:st.rindex(")")]
                    ns = int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
                    res[(pid, tid, cmd[-40:], name)] = ns
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass
    return res
out.write("t,pid,tid,cmd,thread,ns\n")
t0 = time.time(); end = t0 + D
while time.time() < end:
    now = time.time()
    import glob
    for w in glob.glob("/tmp/runfleet-bench-*/**/*-wal", recursive=True):
        try:
            out.write(f"{now:.3f},wal,wal,{w[-30:]},wal,{os.path.getsize(w)}\n")
        except OSError:
            pass
    for (pid, tid, cmd, name), v in procs().items():
        out.write(f"{now:.3f},{pid},{tid},{cmd.strip().replace(',', ' ')},{name},{v}\n")
    time.sleep(0.05)
