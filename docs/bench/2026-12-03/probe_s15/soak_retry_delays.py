import sqlite3, sys, json
c = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True)
tabs = [r[0] for r in c.execute("select name from sqlite_master where type='table'")]
t = [x for x in tabs if 'event' in x][0]
cols = [r[1] for r in c.execute(f"pragma table_info({t})")]
rows = c.execute(f"select * from {t}").fetchall()
ds = []
for r in rows:
    d = dict(zip(cols, r))
    raw = d.get('doc') or d.get('data') or d.get('body')
    e = json.loads(raw) if isinstance(raw, (str, bytes)) else d
    if e.get('type') == 'run_retry_scheduled':
        data = e.get('data', {})
        ds.append((data.get('delivery'), data.get('delay')))
print(cols, sorted(ds, key=lambda x: -x[1])[:5])
