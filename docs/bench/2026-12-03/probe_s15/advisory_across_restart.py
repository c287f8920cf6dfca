import asyncio, tempfile, sys, json
from pathlib import Path
import nats
from nats.js.api import StreamConfig, ConsumerConfig, RetentionPolicy, StorageType, AckPolicy, DeliverPolicy
from runner.localnats import NatsServer

N = 40
async def wait_conn(nc):
    for _ in range(200):
        if nc.is_connected: return
        await asyncio.sleep(0.05)

async def main(variant):
    d = Path(tempfile.mkdtemp()); srv = NatsServer(d); srv.start()
    nc = await nats.connect(srv.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="W", subjects=["w.>"], retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE))
    await js.add_stream(StreamConfig(name="A", subjects=["$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.W.*"], storage=StorageType.FILE))
    await js.add_consumer("W", ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT, ack_wait=1, max_deliver=2, filter_subject="w.>"))
    sub = await js.pull_subscribe_bind("c", stream="W")
    for i in range(N): await js.publish(f"w.{i}", b"x")
    delivered = {}
    async def drain(t):
        end = asyncio.get_running_loop().time() + t
        while asyncio.get_running_loop().time() < end:
            try: msgs = await sub.fetch(100, timeout=0.5)
            except Exception: continue
            for m in msgs:
                s = m.metadata.sequence.stream
                delivered[s] = max(delivered.get(s, 0), m.metadata.num_delivered)
                if variant == "nak": await m.nak()
    await drain(0.8)   # delivery 1, no ack
    if variant == "restart_mid":
        await asyncio.sleep(1.2); await drain(0.5)  # delivery 2 (the last), pending
        await asyncio.to_thread(srv.stop); await asyncio.to_thread(srv.start); await wait_conn(nc)
    else:
        await asyncio.to_thread(srv.stop); await asyncio.to_thread(srv.start); await wait_conn(nc)
    await drain(6)
    info = await js.stream_info("A"); w = await js.stream_info("W")
    print(variant, "max delivered seen", sorted(set(delivered.values())), "advisories", info.state.messages, "work msgs", w.state.messages, "of", N, flush=True)
    await nc.close(); srv.stop()

asyncio.run(main(sys.argv[1]))
