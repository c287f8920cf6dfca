import sqlite3, time, sys, os, uuid, tempfile
sys.path.insert(0, "/work/main")
from store.sqlite.schema import connect
from pathlib import Path
d = Path(tempfile.mkdtemp()); conn = connect(d / "x.db", 1000)
doc = "x" * 720
N = 5000
def txn(i, begin="BEGIN IMMEDIATE"):
    rid = str(uuid.uuid4())
    conn.execute(begin)
    conn.execute("INSERT INTO runs (run_id, tenant, status, origin, failure_code, lease_expires_ms, created_ms, updated_ms, doc) VALUES (?,?,?,?,?,?,?,?,?)", (rid, "default", "queued", "fleet", None, None, 1, 1, doc))
    (last,) = conn.execute("SELECT COALESCE(MAX(seq),0) FROM events WHERE run_id=?", (rid,)).fetchone()
    conn.executemany("INSERT INTO events (run_id, seq, doc) VALUES (?,?,?)", [(rid, 1, "e"*150), (rid, 2, "e"*150)])
    conn.execute("COMMIT")
for label, other in (("alone", False), ("another conn writes between", True)):
    conn2 = connect(d / "x.db", 1000)
    c0 = time.process_time()
    for i in range(N):
        txn(i)
        if other:
            conn2.execute("BEGIN IMMEDIATE"); conn2.execute("UPDATE runs SET updated_ms = updated_ms + 1 WHERE rowid = 1"); conn2.execute("COMMIT")
    print(label, f"{(time.process_time()-c0)/N*1e6:.1f} us/txn (incl. other's if any)")
# just the other's cost
c0 = time.process_time()
for i in range(N):
    conn2.execute("BEGIN IMMEDIATE"); conn2.execute("UPDATE runs SET updated_ms = updated_ms + 1 WHERE rowid = 1"); conn2.execute("COMMIT")
print("other alone", f"{(time.process_time()-c0)/N*1e6:.1f}")
