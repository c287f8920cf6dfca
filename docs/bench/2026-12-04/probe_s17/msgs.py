"""NATS messages per run at an open-loop rate: /varz and /connz before and after."""
import asyncio, json, sys, urllib.request
sys.path.insert(0, "/work/main")
from bench.common import Bench, LeaseEnv, QUICK_LEASE
import bench.common as bc
from bench.latency import TimedPublisher, open_loop
from runner.localnats import NatsServer

MPORT = 18222
orig = NatsServer.__init__
def init(self, work_dir, **kw):
    kw["extra_args"] = ("-m", str(MPORT))
    orig(self, work_dir, **kw)
NatsServer.__init__ = init

def get(path):
    return json.load(urllib.request.urlopen(f"http://127.0.0.1:{MPORT}/{path}"))

async def main():
    rate, secs = float(sys.argv[1]), float(sys.argv[2])
    async with Bench("msgs", lease=QUICK_LEASE) as b:
        rnd = await b.new_round("m")
        pub = TimedPublisher(store=rnd.store, nc=b.nc, js=b.js, settings=rnd.wire, names=rnd.names)
        await rnd.start_runners(2, 16)
        await asyncio.sleep(2)
        from collections import Counter
        import nats as _n
        spy = await _n.connect(b.server.url)
        cnt = Counter()
        async def cb(m):
            import re
            key = re.sub(r"[A-Za-z0-9_-]{12,}", "*", m.subject) + (" +reply" if m.reply else "")
            if m.subject.startswith("$JS.ACK"): key = "$JS.ACK " + m.data[:8].decode(errors="replace")
            cnt[key] += 1
        await spy.subscribe(">", cb=cb)
        b._spy = spy
        await spy.flush()
        v0 = get("varz"); c0 = {c["cid"]: c for c in get("connz?subs=0")["connections"]}
        import subprocess, signal, os
        st = [subprocess.Popen(["strace","-c","-f","-p",str(r.pid),"-o",f"/tmp/p17/strace_{i}.txt"]) for i, r in enumerate(rnd.runners)]
        st.append(subprocess.Popen(["strace","-c","-f","-p",str(b.server._proc.pid),"-o","/tmp/p17/strace_nats.txt"]))
        ids, ach = await open_loop(rnd, pub, rate, secs)
        await rnd.wait_finished(len(ids), within=120)
        for p in st: p.send_signal(signal.SIGINT)
        for p in st: p.wait()
        await rnd.wait_finished(len(ids), within=120)
        await asyncio.sleep(1.5)
        v1 = get("varz"); c1 = get("connz")["connections"]
        n = len(ids)
        await spy.close()
        for k, v in cnt.most_common(): print(f"  subj {k}: {v/n:.2f}/run")
        print(f"runs {n} achieved {ach:.0f}/s")
        print(f"server in_msgs/run {(v1['in_msgs']-v0['in_msgs'])/n:.2f} out_msgs/run {(v1['out_msgs']-v0['out_msgs'])/n:.2f}")
        for c in c1:
            p = c0.get(c["cid"], {"in_msgs":0,"out_msgs":0,"in_bytes":0,"out_bytes":0})
            print(f"  cid {c['cid']} {c.get('name','')}: client->server {(c['in_msgs']-p['in_msgs'])/n:.2f} msgs/run {(c['in_bytes']-p['in_bytes'])/n:.0f} B/run; server->client {(c['out_msgs']-p['out_msgs'])/n:.2f} msgs/run {(c['out_bytes']-p['out_bytes'])/n:.0f} B/run")
asyncio.run(main())
