import asyncio, random, tempfile, sys
from pathlib import Path
import nats
from nats.js.api import StreamConfig, ConsumerConfig, RetentionPolicy, StorageType, AckPolicy
from nats.js.errors import NotFoundError
from runner.localnats import NatsServer
from publisher.queue_snapshot import queue_snapshot

async def check(js, nc, tag):
    snap = await queue_snapshot(nc, "W")
    bad = []
    for seq in range(1, snap.last_seq + 1):
        try:
            await js.get_msg("W", seq); present = True
        except NotFoundError:
            present = False
        g = snap.gone(seq)
        if g is not None and g == present:
            bad.append((seq, g, present))
    print(tag, "first", snap.first_seq, "last", snap.last_seq, "deleted", len(snap.deleted or ()), "mismatch", bad[:10], len(bad), flush=True)
    return len(bad)

async def main(seed):
    rng = random.Random(seed)
    d = Path(tempfile.mkdtemp())
    srv = NatsServer(d); srv.start()
    nc = await nats.connect(srv.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="W", subjects=["w.>"], retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE))
    await js.add_consumer("W", ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT, ack_wait=2, max_deliver=3, filter_subject="w.>"))
    sub = await js.pull_subscribe_bind("c", stream="W")
    bad = 0
    for rnd in range(6):
        for i in range(rng.randint(50, 400)):
            await js.publish(f"w.{i}", b"x" * rng.randint(10, 60000))
        try:
            msgs = await sub.fetch(rng.randint(20, 300), timeout=1)
        except Exception:
            msgs = []
        for m in msgs:
            r = rng.random()
            if r < 0.6: await m.ack_sync()
            elif r < 0.75: await js.delete_msg("W", m.metadata.sequence.stream)
            elif r < 0.9: await m.nak()
        bad += await check(js, nc, f"round {rnd}")
        if rnd % 2 == 1:
            await asyncio.to_thread(srv.stop); await asyncio.to_thread(srv.start)
            for _ in range(100):
                if nc.is_connected: break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            bad += await check(js, nc, f"round {rnd} after restart")
    await nc.close(); srv.stop()
    return bad

print("total mismatches", asyncio.run(main(int(sys.argv[1]))))
