import asyncio, tempfile, sys, json
from pathlib import Path
import nats
from nats.js.api import StreamConfig, ConsumerConfig, RetentionPolicy, StorageType, AckPolicy
from runner.localnats import NatsServer

N = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
async def wait_conn(nc):
    for _ in range(400):
        if nc.is_connected: return
        await asyncio.sleep(0.05)

async def main(offset):
    d = Path(tempfile.mkdtemp()); srv = NatsServer(d); srv.start()
    nc = await nats.connect(srv.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="W", subjects=["w.>"], retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE))
    await js.add_stream(StreamConfig(name="A", subjects=["$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.W.*"], storage=StorageType.FILE))
    await js.add_consumer("W", ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT, ack_wait=1, max_deliver=2, filter_subject="w.>", max_ack_pending=-1))
    sub = await js.pull_subscribe_bind("c", stream="W")
    for i in range(N): await js.publish(f"w.{i}", b"x")
    async def take(want):
        got = 0
        while got < want:
            try: msgs = await sub.fetch(min(500, want-got), timeout=2)
            except Exception: break
            got += len(msgs)
        return got
    a = await take(N); t = asyncio.get_running_loop().time()
    b = await take(N)
    # keep a pull waiting so redelivery/expiry is processed
    async def puller():
        while True:
            try: await sub.fetch(100, timeout=0.5)
            except Exception: pass
    pass
    p = asyncio.create_task(puller())
    await asyncio.sleep(0.95 + offset)
    await asyncio.to_thread(srv.stop)
    await asyncio.to_thread(srv.start); await wait_conn(nc)
    await asyncio.sleep(4)
    p.cancel()
    ai = await js.stream_info("A"); wi = await js.stream_info("W"); ci = await js.consumer_info("W", "c")
    print(f"deliveries {a}+{b}; advisories {ai.state.messages} of {N}; work msgs {wi.state.messages}; ack_floor {ci.ack_floor.stream_seq} ack_pending {ci.num_ack_pending} pending {ci.num_pending} redelivered {ci.num_redelivered}", flush=True)
    await nc.close(); srv.stop()

asyncio.run(main(float(sys.argv[1])))
