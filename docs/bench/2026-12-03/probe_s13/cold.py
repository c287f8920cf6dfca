import time, json, sys
sys.path.insert(0, "/work/main")
from store.models import RunDocument
import pieces_mk
doc = pieces_mk.mk(); text = doc.model_dump_json()
def work():
    for _ in range(5):
        d = RunDocument.model_validate_json(text); json.loads(text); d.model_dump()
for _ in range(200): work()
for gap in (0, 0.0005, 0.002, 0.01):
    ts = []
    for _ in range(300):
        if gap: time.sleep(gap)
        t0 = time.thread_time_ns(); work(); ts.append(time.thread_time_ns() - t0)
    ts.sort()
    print(f"gap {gap*1e3:5.1f} ms: work cpu median {ts[len(ts)//2]/1e3:6.1f} us  p90 {ts[int(len(ts)*.9)]/1e3:6.1f}")
