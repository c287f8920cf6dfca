"""How long a full collection takes in a started `runfleet console` process, before and after
the start-up heap is frozen (the pause every request in flight waits out)."""
import asyncio, gc, os, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, ".")
from runner.localnats import NatsServer

def full_collect_ms(n: int = 5) -> float:
    best = []
    for _ in range(n):
        t = time.perf_counter(); gc.collect(); best.append((time.perf_counter() - t) * 1e3)
    return sorted(best)[len(best) // 2]

async def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    server = NatsServer(tmp / "nats"); server.start()
    os.environ.update({"RUNFLEET_DATA": str(tmp / "data"), "RUNFLEET_NATS_URL": server.url,
        "RUNFLEET_STORE_URL": f"sqlite:///{tmp / 'runs.db'}", "RUNFLEET_BLOB_URL": f"file://{tmp / 'blobs'}",
        "RUNFLEET_CONSOLE_TOKEN": "x"})
    from runner.console import serve
    done = asyncio.Event()
    def started(url: str) -> None:
        done.set()
    task = asyncio.ensure_future(serve("127.0.0.1", 0, started=started))
    await done.wait()
    tracked = len(gc.get_objects())
    before = full_collect_ms()
    gc.freeze()
    after = full_collect_ms()
    print(f"console process, started: {tracked:,} tracked objects; a full collection takes "
          f"{before:.1f} ms, {after * 1e3:.1f} µs once they are frozen (median of 5)")
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    server.stop()
asyncio.run(main())
